"""One attempt of a task: what a worker holds while it runs, how it keeps its lease, how it ends.

A claim starts an attempt (`ClaimedTask`, carrying the fencing token `lease_token`); the handler may
extend its deadline (`heartbeat`, also saving a checkpoint or its progress); the worker ends it
with a `Report`, which `finishing.finish_attempts` writes. Every write is guarded by `status = 'processing' AND
lease_token = <the attempt's token>`, so an attempt that was rescued or stopped changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from ..exceptions import LeaseLost
from ..models import ScheduleCfg, Status, Task
from .outcomes import Outcome, Report, StopRequest  # noqa: F401 - the engine's names for them
from .progress import Progress
from .validation import json_text


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
    # The newer version that superseded this task while it ran (read again when the attempt ends,
    # see finishing.py: a task that would go back to pending is stopped instead).
    superseded_by: int | None = None
    # The row's other columns as its claim left them, if the claim was asked for them (claim_batch's `shown`).
    shown: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # Set when the attempt was taken away while it runs (terminated by an operator, or rescued).
    stop_requested: StopRequest = field(default_factory=StopRequest, repr=False, compare=False)

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
        """An attempt of the task in `row` (which holds at least sql.CLAIM_COLUMNS), per-task settings resolved."""
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

    @classmethod
    def running(cls, row: dict[str, Any], cfg: ScheduleCfg, now: datetime) -> ClaimedTask:
        """The attempt now running on the task in `row` (read with its worker, started_at and deadline)."""
        return cls.from_row(
            row,
            cfg,
            attempt=row["attempts"],  # counted when it was claimed
            lease_token=row["lease_token"],
            worker_id=row["worker_id"],
            claimed_at=row["started_at"] or now,
            lease_expires_at=row["lease_expires_at"] or now,
        )


def heartbeat(
    task: ClaimedTask, *, checkpoint: Any = ..., progress: Progress | None = None, now: datetime | None = None
) -> datetime:
    """Extend this attempt's deadline by its timeout (optionally saving a checkpoint, progress); raises LeaseLost.

    One UPDATE, guarded by the attempt's lease. A checkpoint no database could store (see
    validation.json_text) raises InvalidTask, writing nothing.
    """
    if checkpoint is not ...:
        json_text("checkpoint", checkpoint)
    now = now or timezone.now()
    deadline = now + timedelta(seconds=task.timeout)
    changes: dict[str, Any] = {"lease_expires_at": deadline, "heartbeat_at": now, "updated_at": now}
    if checkpoint is not ...:
        changes["checkpoint"] = checkpoint
    if progress is not None:
        changes["progress"] = progress.stored(task.lease_token, now)
    updated = Task.objects.filter(id=task.id, status=Status.PROCESSING, lease_token=task.lease_token).update(**changes)
    if not updated:
        raise LeaseLost(f"task {task.id} attempt {task.attempt} no longer holds its lease")
    task.lease_expires_at = deadline
    return deadline


class DatabaseChannel:
    """The local worker's AttemptChannel (see runtime.context): the lease kept by writing the task row."""

    def __init__(self, task: ClaimedTask) -> None:
        self.task = task

    @property
    def deadline(self) -> datetime:
        return self.task.lease_expires_at

    @property
    def stop_requested(self) -> bool:
        return self.task.stop_requested.is_set()

    def heartbeat(self, checkpoint: Any = ..., progress: Progress | None = None) -> datetime:
        return heartbeat(self.task, checkpoint=checkpoint, progress=progress)


def lost_attempts(attempts: list[ClaimedTask]) -> list[ClaimedTask]:
    """The attempts among these that no longer hold their task (stopped, rescued, or gone): one query."""
    if not attempts:
        return []
    held = set(
        Task.objects.filter(id__in=[a.id for a in attempts], status=Status.PROCESSING).values_list("id", "lease_token")
    )
    return [a for a in attempts if (a.id, a.lease_token) not in held]


# Outcomes of an attempt that ran and failed (a schedule-log entry's "outcome").
FAILED_OUTCOMES = frozenset({Outcome.ERROR, Outcome.FAIL, Outcome.RESCUED, Outcome.TERMINATED})


@dataclass(frozen=True)
class PastAttempt:
    """One attempt as its task's schedule log recorded it."""

    attempt: int
    worker_id: str
    started_at: datetime | None
    outcome: str
    error: str
    exception: str  # class path; "" for attempts that did not fail, and for entries older than this field
    traceback: str

    @property
    def failed(self) -> bool:
        return self.outcome in FAILED_OUTCOMES


def past_attempts(schedule_log: list[dict[str, Any]] | None) -> list[PastAttempt]:
    """The attempts a schedule log holds (its last SCHEDULE_LOG_SIZE entries), oldest first; snoozes excluded."""
    attempts = []
    for entry in reversed(schedule_log or []):
        if entry.get("outcome") == Outcome.SNOOZE:
            continue
        started = entry.get("started_at")
        attempts.append(
            PastAttempt(
                attempt=entry.get("attempt", 0),
                worker_id=entry.get("worker", ""),
                started_at=datetime.fromisoformat(started) if started else None,
                outcome=entry.get("outcome", ""),
                error=entry.get("error", ""),
                exception=entry.get("exception", ""),
                traceback=entry.get("traceback", ""),
            )
        )
    return attempts
