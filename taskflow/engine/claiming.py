"""Taking due tasks for a worker: one locked read and one UPDATE per batch (one statement on PostgreSQL).

Order: `order_time` ascending, i.e. due time moved earlier by priority x aging. Higher priority
runs first, yet a low-priority task is overtaken only by tasks enqueued less than
(priority difference x aging) seconds after it, so a flood can delay it but never starve it.
Tasks of one `order_time` (one enqueue_many, say) come in no promised order among themselves: id
order on MariaDB and SQLite, whatever order the index holds them in on PostgreSQL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from ..models import ScheduleCfg, Status
from . import limiter, sql
from .attempts import ClaimedTask


class ClaimConflict(RuntimeError):
    """The rows read for a claim changed before the UPDATE (a database without working row locks)."""


def claim_batch(
    cfg: ScheduleCfg,
    limit: int,
    worker_id: str,
    *,
    host: str = "",
    exact_limit: int = 0,
    exact_global_limit: int | None = None,
    now: datetime | None = None,
    reserve: int = 0,
    shown: bool = False,
) -> list[ClaimedTask]:
    """Claim up to `limit` due pending tasks of `cfg.task_type` for `worker_id`, and `reserve` more after them.

    With `shown`, each attempt also carries the row's sql.SHOWN_COLUMNS (`ClaimedTask.shown`), read by
    the claim itself: what a remote hold answers besides the attempt.

    The first `limit` attempts start now. The reserved ones (claimed ahead of free threads) are held
    for the worker but not started: their row's `started_at` stays NULL until `start_reserved`, so a
    worker that dies with them has them handed back uncounted (rescue.py). The caller does not
    reserve tasks of a limited type: a reserved task would hold a slot no handler uses.

    `exact_limit` (per type) and `exact_global_limit` (all types; None: GLOBAL_CONCURRENCY_LIMIT
    when there is no Redis limiter) > 0 enforce concurrency limits in the database: a row is
    locked and the running count taken inside the claim's transaction, so concurrent claimers
    can never together exceed them (see limiter.exact_room).
    """
    if limit <= 0 and reserve <= 0:
        return []
    started = max(0, limit)
    now = now or timezone.now()
    table = sql.task_table()
    if exact_global_limit is None:
        exact_global_limit = limiter.exact_global_limit()
    if exact_global_limit > 0:
        limiter.ensure_gate()
    limited = exact_limit > 0 or exact_global_limit > 0
    if limited:
        reserve = 0  # a reserved task of a limited type would hold a slot no handler uses
    if not limited and reserve <= 0 and sql.claims_in_one_statement():
        rows = sql.claim_due(table, cfg.task_type, started, host, worker_id, now, cfg.max_processing_time, shown=shown)
        return [_claimed(row, cfg, worker_id, now, counted=True, shown=shown) for row in rows]
    # Without limits to count, the read and the UPDATE are all the transaction holds: on MySQL it
    # then skips a round trip (see sql.transaction_of_statements).
    with transaction.atomic() if limited else sql.transaction_of_statements():
        if limited:
            started = limiter.exact_room(cfg.task_type, started, exact_limit, exact_global_limit)
            if started <= 0:
                return []
        rows = sql.select_due(table, cfg.task_type, started + max(0, reserve), host, now, shown=shown)
        if not rows:
            return []
        claimed = [_claimed(row, cfg, worker_id, now, shown=shown, reserved=i >= started) for i, row in enumerate(rows)]
        by_deadline: dict[datetime, list[int]] = defaultdict(list)
        for task in claimed:
            by_deadline[task.lease_expires_at].append(task.id)
        reserved = {task.id for task in claimed[started:]}
        updated = sum(
            sql.mark_processing(table, ids, worker_id, now, deadline, reserved=reserved.intersection(ids))
            for deadline, ids in by_deadline.items()
        )
        if updated != len(claimed):
            raise ClaimConflict(f"claimed {len(claimed)} rows but updated {updated}")
    return claimed


def claim_within_limit(
    cfg: ScheduleCfg,
    wanted: int,
    worker_id: str,
    slots: limiter.Limiter,
    *,
    host: str = "",
    now: datetime | None = None,
    shown: bool = False,
) -> list[ClaimedTask]:
    """Claim up to `wanted` tasks of a type under concurrency limits: take the limiter's slots, claim
    (the database counting exactly where the limiter says so), then give back the slots not used."""
    grant = slots.take(cfg.task_type, wanted, cfg.concurrency_limit)
    tasks: list[ClaimedTask] = []
    try:
        exact_limit = slots.exact_db_limit(cfg.concurrency_limit)
        tasks = claim_batch(cfg, grant.slots, worker_id, host=host, exact_limit=exact_limit, now=now, shown=shown)
    finally:
        slots.confirm(grant, tasks)
    return tasks


def _claimed(
    row: dict[str, Any],
    cfg: ScheduleCfg,
    worker_id: str,
    now: datetime,
    *,
    counted: bool = False,
    shown: bool = False,
    reserved: bool = False,
) -> ClaimedTask:
    """The attempt a claim starts on the task in `row` (read before its UPDATE, or after it if `counted`);
    `reserved`: claimed ahead, its row's started_at left NULL (see claim_batch)."""
    timeout = row["timeout"] or cfg.max_processing_time
    step = 0 if counted else 1
    attempt = ClaimedTask.from_row(
        row,
        cfg,
        attempt=row["attempts"] + step,
        lease_token=row["lease_token"] + step,
        worker_id=worker_id,
        claimed_at=now,
        lease_expires_at=now + timedelta(seconds=timeout),
    )
    if shown:
        # The row's columns as the claim leaves them, beside what the attempt carries: those it read
        # (with the row's own max_retries and timeout, None for the type's, which the attempt
        # resolves) and those its UPDATE writes (mark_processing, claim_due).
        attempt.shown = {name: row[name] for name in (*sql.SHOWN_COLUMNS, "max_retries", "timeout", "run_after")}
        attempt.shown.update(
            status=Status.PROCESSING,
            attempts=attempt.attempt,
            worker_id=worker_id,
            started_at=None if reserved else now,
            updated_at=now,
            lease_expires_at=attempt.lease_expires_at,
        )
    return attempt


def start_reserved(tasks: list[ClaimedTask], now: datetime | None = None) -> list[ClaimedTask]:
    """Start these reserved attempts (claimed ahead, see claim_batch); returns those still held, now started.

    One UPDATE per lease token (usually one): an attempt taken away meanwhile (handed back by a
    rescue, stopped by an operator) is left alone and not returned.
    """
    if not tasks:
        return []
    now = now or timezone.now()
    by_worker: dict[str, list[ClaimedTask]] = defaultdict(list)
    for task in tasks:
        by_worker[task.worker_id].append(task)
    started: list[ClaimedTask] = []
    for worker_id, group in by_worker.items():
        held = start_held(worker_id, [(t.id, t.lease_token) for t in group], now)
        started += [t for t in group if (t.id, t.lease_token) in held]
    for task in started:
        task.claimed_at = now
    return started


def start_held(
    worker_id: str, attempts: Iterable[tuple[int, int]], now: datetime | None = None
) -> set[tuple[int, int]]:
    """Start the reserved attempts (task id, lease token) that `worker_id` holds; returns those held, now started.

    One UPDATE per lease token (usually one), guarded by the token and the worker. One started
    before is returned too: this may be a retry after an outage hid a start that landed.
    """
    now = now or timezone.now()
    table = sql.task_table()
    by_token: dict[int, list[int]] = defaultdict(list)
    for task_id, token in attempts:
        by_token[token].append(task_id)
    held: set[tuple[int, int]] = set()
    for token, ids in by_token.items():
        if sql.mark_started(table, ids, token, worker_id, now) != len(ids):
            # Some were taken away (handed back by a rescue, stopped by an operator), or started before.
            ids = sql.ids_held(table, ids, token, worker_id)
        held.update((task_id, token) for task_id in ids)
    return held
