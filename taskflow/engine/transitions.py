"""The state machine: what the end of an attempt writes to its task row.

`row_changes` is the one place that decides retry, failure, success, snooze, next stage and
hand-back; the worker's reports, taskwatch's rescues and the API's reports all go through it (via
`finishing.finish_attempts`), so a rescued attempt is retried or failed by the same rules as any
failed one, and a task that always times out ends failed instead of running forever.

A task going back to pending whose newer version was enqueued meanwhile is stopped instead.
`finish_attempts` reads that mark (and the priority and retry budget an operator may have changed
while the attempt ran) under the row lock before deciding, so what it writes is what it believes
it wrote; `sql.update_attempts` still stops such a row should a caller not have read the mark.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from ..models import SCHEDULE_LOG_SIZE, ScheduleCfg, Status
from .attempts import Outcome, Report
from .retry import RetryPolicy

MAX_MESSAGE = 4000
# The end of a failed attempt's traceback kept in its schedule-log entry (where the exception is
# named); the whole of the last one is in status_msg.
MAX_LOG_TRACEBACK = 2000


def order_time(run_after: datetime, priority: int, aging: float) -> datetime:
    """The scheduling key: run_after moved earlier by `aging` seconds per priority point."""
    return run_after - timedelta(seconds=priority * aging)


def row_changes(report: Report, cfg: ScheduleCfg, now: datetime, rand: Any = None) -> dict[str, Any]:
    """The columns a report writes: where the state machine decides retry, failure or success."""
    task = report.task
    entry = {
        "attempt": task.attempt,
        "worker": task.worker_id,
        "started_at": task.claimed_at.isoformat(),
        "cost_ms": report.cost_ms,
        "outcome": str(report.outcome),
        "error": report.error[:500],
    }
    if report.exception:
        # Per attempt, so every failed attempt can be shown with its exception (django.tasks errors).
        entry["exception"] = report.exception[:200]
        entry["traceback"] = (report.detail or f"{report.exception}: {report.error}\n")[-MAX_LOG_TRACEBACK:]
    changes: dict[str, Any] = {
        "schedule_log": [entry, *task.schedule_log][:SCHEDULE_LOG_SIZE],
        "lease_expires_at": None,
        "updated_at": now,
    }
    message = (report.error + ("\n" + report.detail if report.detail else ""))[:MAX_MESSAGE]

    def requeue(run_after: datetime, priority: int) -> None:
        changes.update(
            status=Status.PENDING, run_after=run_after, order_time=order_time(run_after, priority, cfg.priority_aging)
        )

    outcome = Outcome.ERROR if report.outcome == Outcome.RESCUED else report.outcome
    if report.outcome in (Outcome.RESCUED, Outcome.TERMINATED):
        # Taking an attempt away changes the fencing token: its late writes are refused.
        changes["lease_token"] = task.lease_token + 1
    if outcome == Outcome.ERROR and task.attempt > task.max_retries:
        outcome = Outcome.FAIL
        message = f"failed after {task.attempt} attempts: {message}"
    if outcome == Outcome.SUCCESS:
        changes.update(status=Status.SUCCESS, result=report.result, status_msg="", finished_at=now)
    elif outcome == Outcome.FAIL:
        changes.update(status=Status.FAILED, status_msg=message, finished_at=now)
    elif outcome == Outcome.TERMINATED:
        changes.update(status=Status.STOPPED, status_msg=message, finished_at=now)
    elif outcome == Outcome.ERROR:
        policy = RetryPolicy.for_config(cfg)
        delay = policy.next_delay(task.attempt, rand) if rand else policy.next_delay(task.attempt)
        requeue(now + timedelta(seconds=delay), task.priority)
        changes["status_msg"] = f"attempt {task.attempt} failed, retry in {delay:.1f}s: {message}"
        if task.retry_same_host > 0:
            # Back to the host that first ran it (its local files, caches), for a grace period.
            host = task.prefer_host or worker_host(task.worker_id)
            changes.update(prefer_host=host, prefer_host_until=now + timedelta(seconds=task.retry_same_host))
    elif outcome == Outcome.SNOOZE:
        requeue(now + timedelta(seconds=report.delay), task.priority)
        changes.update(attempts=task.attempt - 1, status_msg=f"snoozed {report.delay:g}s {report.error}".strip())
    elif outcome == Outcome.NEXT_STAGE:
        step = report.next_stage
        assert step is not None
        priority = task.priority if step.priority is None else step.priority
        requeue(now + timedelta(seconds=step.delay), priority)
        changes.update(stage=step.stage, priority=priority, attempts=0, checkpoint=None, status_msg="")
        if step.context is not None:
            changes["context"] = step.context
    elif outcome == Outcome.HANDBACK:
        changes.update(status=Status.PENDING, attempts=task.attempt - 1, worker_id="", started_at=None)
        # Its place as before, unless an operator changed its priority while it was held.
        changes["order_time"] = order_time(task.run_after, task.priority, cfg.priority_aging)
        changes["status_msg"] = "handed back unstarted by a stopping worker"
        changes["schedule_log"] = task.schedule_log
    if changes.get("status") == Status.PENDING and task.superseded_by is not None:
        # A newer version was enqueued while this attempt ran: this one is not queued again.
        changes.update(status=Status.STOPPED, status_msg=f"superseded by version {task.superseded_by}", finished_at=now)
    return changes


def worker_host(worker_id: str) -> str:
    """The host part of a worker id ("host:pid:suffix")."""
    parts = worker_id.rsplit(":", 2)
    return parts[0] if len(parts) == 3 else ""
