"""Taking due tasks for a worker: one locked SELECT and one UPDATE per batch.

Order: `order_time` ascending, i.e. due time moved earlier by priority x aging. Higher priority
runs first, yet a low-priority task is overtaken only by tasks enqueued less than
(priority difference x aging) seconds after it, so a flood can delay it but never starve it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from . import limiter, sqlvalues
from .models import ScheduleCfg, Status, Task

TASK_COLUMNS = (
    "id",
    "task_type",
    "key",
    "version",
    "priority",
    "payload",
    "context",
    "checkpoint",
    "stage",
    "attempts",
    "max_retries",
    "timeout",
    "lease_token",
    "trace_id",
    "schedule_log",
    "run_after",
    "retry_same_host",
    "prefer_host",
)


@dataclass
class ClaimedTask:
    """What a worker holds for one attempt; `lease_token` must accompany every report."""

    id: int
    task_type: str
    key: str | None
    version: int
    priority: int
    payload: Any
    context: Any
    checkpoint: Any
    stage: str
    attempt: int
    max_retries: int
    timeout: int
    lease_token: int
    trace_id: str
    schedule_log: list[dict[str, Any]]
    run_after: datetime
    worker_id: str
    claimed_at: datetime
    lease_expires_at: datetime
    retry_same_host: int = 0
    prefer_host: str = ""

    @classmethod
    def from_row(
        cls,
        row: dict[str, Any],
        cfg: ScheduleCfg,
        *,
        attempt: int,
        lease_token: int,
        worker_id: str,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> ClaimedTask:
        """An attempt of the task in `row` (which holds at least TASK_COLUMNS), per-task settings resolved."""
        return cls(
            id=row["id"],
            task_type=row["task_type"],
            key=row["key"],
            version=row["version"],
            priority=row["priority"],
            payload=row["payload"],
            context=row["context"],
            checkpoint=row["checkpoint"],
            stage=row["stage"],
            attempt=attempt,
            max_retries=cfg.max_retry_num if row["max_retries"] is None else row["max_retries"],
            timeout=row["timeout"] or cfg.max_processing_time,
            lease_token=lease_token,
            trace_id=row["trace_id"],
            schedule_log=row["schedule_log"] or [],
            run_after=row["run_after"],
            worker_id=worker_id,
            claimed_at=claimed_at,
            lease_expires_at=lease_expires_at,
            retry_same_host=row["retry_same_host"],
            prefer_host=row["prefer_host"],
        )


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
) -> list[ClaimedTask]:
    """Claim up to `limit` due pending tasks of `cfg.task_type` for `worker_id`.

    `exact_limit` (per type) and `exact_global_limit` (all types; None: GLOBAL_CONCURRENCY_LIMIT
    when there is no Redis limiter) > 0 enforce concurrency limits in the database: a row is
    locked and the running count taken inside the claim's transaction, so concurrent claimers
    can never together exceed them (see limiter.exact_room).
    """
    if limit <= 0:
        return []
    now = now or timezone.now()
    if exact_global_limit is None:
        exact_global_limit = limiter.exact_global_limit()
    if exact_global_limit > 0:
        limiter.ensure_gate()
    with transaction.atomic():
        if exact_limit > 0 or exact_global_limit > 0:
            limit = limiter.exact_room(cfg.task_type, limit, exact_limit, exact_global_limit)
            if limit <= 0:
                return []
        rows = _select_due(cfg.task_type, limit, host, now)
        if not rows:
            return []
        claimed = [_claimed(dict(zip(TASK_COLUMNS, row, strict=True)), cfg, worker_id, now) for row in rows]
        by_deadline: dict[datetime, list[int]] = defaultdict(list)
        for task in claimed:
            by_deadline[task.lease_expires_at].append(task.id)
        updated = sum(_mark_processing(ids, worker_id, now, deadline) for deadline, ids in by_deadline.items())
        if updated != len(claimed):
            raise ClaimConflict(f"claimed {len(claimed)} rows but updated {updated}")
    return claimed


# Claims run thousands of times a second, so their two statements are written out rather than
# compiled by the ORM on every call; the values are the same ones the ORM would send.
def _select_due(task_type: str, limit: int, host: str, now: datetime) -> list[tuple[Any, ...]]:
    qn = connection.ops.quote_name
    columns = ", ".join(qn(Task._meta.get_field(name).column) for name in TASK_COLUMNS)
    at = connection.ops.adapt_datetimefield_value(now)
    hosts = f"{qn('prefer_host')} = '' OR {qn('prefer_host_until')} <= %s"
    params: list[Any] = [Status.PENDING.value, task_type, at, at]
    if host:
        hosts += f" OR {qn('prefer_host')} = %s"
        params.append(host)
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    sql = (
        f"SELECT {columns} FROM {qn(Task._meta.db_table)} "
        f"WHERE {qn('status')} = %s AND {qn('task_type')} = %s AND {qn('run_after')} <= %s AND ({hosts}) "
        f"ORDER BY {qn('order_time')} LIMIT %s{lock}"
    )
    params.append(limit)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    decode = sqlvalues.json_from_db()
    to_datetime = sqlvalues.datetime_from_db()
    out = []
    for row in rows:
        row = list(row)
        for i in _JSON_POSITIONS:
            row[i] = decode(row[i])
        row[_RUN_AFTER] = to_datetime(row[_RUN_AFTER])
        out.append(tuple(row))
    return out


def _mark_processing(ids: list[int], worker_id: str, now: datetime, deadline: datetime) -> int:
    qn = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    marks = ", ".join(["%s"] * len(ids))
    sql = (
        f"UPDATE {qn(Task._meta.db_table)} SET {qn('status')} = %s, "
        f"{qn('attempts')} = {qn('attempts')} + 1, {qn('lease_token')} = {qn('lease_token')} + 1, "
        f"{qn('worker_id')} = %s, {qn('started_at')} = %s, {qn('heartbeat_at')} = %s, "
        f"{qn('lease_expires_at')} = %s, {qn('updated_at')} = %s "
        f"WHERE {qn('id')} IN ({marks}) AND {qn('status')} = %s"
    )
    at = adapt(now)
    params = [Status.PROCESSING.value, worker_id, at, at, adapt(deadline), at, *ids, Status.PENDING.value]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


_JSON_POSITIONS = [
    i for i, name in enumerate(TASK_COLUMNS) if name in ("payload", "context", "checkpoint", "schedule_log")
]
_RUN_AFTER = TASK_COLUMNS.index("run_after")


def _claimed(row: dict[str, Any], cfg: ScheduleCfg, worker_id: str, now: datetime) -> ClaimedTask:
    timeout = row["timeout"] or cfg.max_processing_time
    return ClaimedTask.from_row(
        row,
        cfg,
        attempt=row["attempts"] + 1,
        lease_token=row["lease_token"] + 1,
        worker_id=worker_id,
        claimed_at=now,
        lease_expires_at=now + timedelta(seconds=timeout),
    )
