"""Taking due tasks for a worker: one locked SELECT and one UPDATE per batch.

Order: `order_time` ascending, i.e. due time moved earlier by priority x aging. Higher priority
runs first, yet a low-priority task is overtaken only by tasks enqueued less than
(priority difference x aging) seconds after it, so a flood can delay it but never starve it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from . import limiter
from .models import ScheduleCfg, Status, Task

_COLUMNS = (
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
    extra: dict[str, Any] = field(default_factory=dict)


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
    with transaction.atomic():
        if exact_limit > 0 or exact_global_limit > 0:
            limit = limiter.exact_room(cfg.task_type, limit, exact_limit, exact_global_limit)
            if limit <= 0:
                return []
        due = Task.objects.filter(status=Status.PENDING, task_type=cfg.task_type, run_after__lte=now)
        if host:
            due = due.filter(Q(prefer_host="") | Q(prefer_host=host) | Q(prefer_host_until__lte=now))
        else:
            due = due.filter(Q(prefer_host="") | Q(prefer_host_until__lte=now))
        rows = list(due.select_for_update(skip_locked=True).order_by("order_time").values_list(*_COLUMNS)[:limit])
        if not rows:
            return []
        claimed = [_claimed(dict(zip(_COLUMNS, row, strict=True)), cfg, worker_id, now) for row in rows]
        by_deadline: dict[datetime, list[int]] = defaultdict(list)
        for task in claimed:
            by_deadline[task.lease_expires_at].append(task.id)
        updated = 0
        for deadline, task_ids in by_deadline.items():
            updated += Task.objects.filter(id__in=task_ids, status=Status.PENDING).update(
                status=Status.PROCESSING,
                attempts=F("attempts") + 1,
                lease_token=F("lease_token") + 1,
                worker_id=worker_id,
                started_at=now,
                heartbeat_at=now,
                lease_expires_at=deadline,
                updated_at=now,
            )
        if updated != len(claimed):
            raise ClaimConflict(f"claimed {len(claimed)} rows but updated {updated}")
    return claimed


def _claimed(row: dict[str, Any], cfg: ScheduleCfg, worker_id: str, now: datetime) -> ClaimedTask:
    timeout = row["timeout"] or cfg.max_processing_time
    return ClaimedTask(
        id=row["id"],
        task_type=row["task_type"],
        key=row["key"],
        version=row["version"],
        priority=row["priority"],
        payload=row["payload"],
        context=row["context"],
        checkpoint=row["checkpoint"],
        stage=row["stage"],
        attempt=row["attempts"] + 1,
        max_retries=cfg.max_retry_num if row["max_retries"] is None else row["max_retries"],
        timeout=timeout,
        lease_token=row["lease_token"] + 1,
        trace_id=row["trace_id"],
        schedule_log=row["schedule_log"] or [],
        run_after=row["run_after"],
        worker_id=worker_id,
        claimed_at=now,
        lease_expires_at=now + timedelta(seconds=timeout),
    )
