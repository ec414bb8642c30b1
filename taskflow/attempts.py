"""Everything that changes a task during one attempt: heartbeats, checkpoints and the final report.

Every write is guarded by `status = 'processing' AND lease_token = <the attempt's token>`, so a
report from an attempt that was rescued or taken away changes nothing. Final reports are applied
in batches: one UPDATE per group of tasks that share a token and the set of columns written.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from . import sqlvalues
from .claiming import ClaimedTask
from .enqueueing import order_time
from .exceptions import NextStage
from .models import SCHEDULE_LOG_SIZE, ScheduleCfg, Status, Task
from .retry import RetryPolicy

MAX_MESSAGE = 4000


class Outcome(enum.StrEnum):
    SUCCESS = "success"
    ERROR = "error"  # retried by the policy while attempts remain
    FAIL = "fail"  # permanent: no more attempts
    SNOOZE = "snooze"  # run later, the attempt not counted
    NEXT_STAGE = "next_stage"
    RESCUED = "rescued"  # taken away by taskwatch (dead worker or deadline): a failed attempt
    HANDBACK = "handback"  # claimed but never started: back to pending as it was
    LOST = "lost"  # the attempt was taken away while running: nothing to write


@dataclass
class Report:
    """The end of one attempt, as the worker saw it."""

    task: ClaimedTask
    outcome: Outcome
    result: Any = None
    error: str = ""
    detail: str = ""  # traceback, kept in status_msg
    delay: float = 0.0
    next_stage: NextStage | None = None
    cost_ms: int = 0


class LeaseLost(Exception):  # noqa: N818 - a signal to the handler, not a bug
    """This attempt no longer owns its task (it was rescued or stopped): stop working on it."""


def heartbeat(task: ClaimedTask, *, checkpoint: Any = ..., now: datetime | None = None) -> datetime:
    """Extend this attempt's deadline by its timeout (optionally saving a checkpoint); raises LeaseLost."""
    now = now or timezone.now()
    deadline = now + timedelta(seconds=task.timeout)
    changes: dict[str, Any] = {"lease_expires_at": deadline, "heartbeat_at": now, "updated_at": now}
    if checkpoint is not ...:
        changes["checkpoint"] = checkpoint
    updated = Task.objects.filter(id=task.id, status=Status.PROCESSING, lease_token=task.lease_token).update(**changes)
    if not updated:
        raise LeaseLost(f"task {task.id} attempt {task.attempt} no longer holds its lease")
    task.lease_expires_at = deadline
    return deadline


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
    if outcome == Outcome.ERROR and task.attempt > task.max_retries:
        outcome = Outcome.FAIL
        message = f"failed after {task.attempt} attempts: {message}"
    if outcome == Outcome.SUCCESS:
        changes.update(status=Status.SUCCESS, result=report.result, status_msg="", finished_at=now)
    elif outcome == Outcome.FAIL:
        changes.update(status=Status.FAILED, status_msg=message, finished_at=now)
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
        changes["status_msg"] = "handed back unstarted by a stopping worker"
        changes["schedule_log"] = task.schedule_log
    return changes


def worker_host(worker_id: str) -> str:
    """The host part of a worker id ("host:pid:suffix")."""
    parts = worker_id.rsplit(":", 2)
    return parts[0] if len(parts) == 3 else ""


def apply_reports(reports: list[Report], cfgs: dict[str, ScheduleCfg]) -> list[Report]:
    """Write a batch of final reports; returns the reports that were accepted (not stale)."""
    if not reports:
        return []
    now = timezone.now()
    groups: dict[tuple[int, frozenset[str]], dict[int, tuple[Report, dict[str, Any]]]] = defaultdict(dict)
    for report in reports:
        changes = row_changes(report, cfgs[report.task.task_type], now)
        groups[(report.task.lease_token, frozenset(changes))][report.task.id] = (report, changes)
    accepted: list[Report] = []
    # All groups or none, so a retried flush never mistakes its own earlier writes for stale
    # reports; a single UPDATE is atomic by itself and skips the transaction's round trips.
    with transaction.atomic() if len(groups) > 1 else nullcontext():
        for (token, _), rows in groups.items():
            count = _guarded_update({tid: ch for tid, (_, ch) in rows.items()}, token)
            if count == len(rows):
                accepted.extend(r for r, _ in rows.values())
            else:
                # Some were stale: ours are exactly those now carrying this flush's timestamp.
                mine = set(
                    Task.objects.filter(id__in=list(rows), lease_token=token, updated_at=now).values_list(
                        "id", flat=True
                    )
                )
                accepted.extend(r for tid, (r, _) in rows.items() if tid in mine)
    return accepted


def _guarded_update(rows: dict[int, dict[str, Any]], token: int) -> int:
    """One UPDATE for many rows: columns equal across the rows set once, the others through CASE id."""
    qn = connection.ops.quote_name
    ids = list(rows)
    assignments: list[str] = []
    params: list[Any] = []
    for name in next(iter(rows.values())):
        to_db, mark = sqlvalues.to_db(name), sqlvalues.placeholder(name)
        values = [rows[i][name] for i in ids]
        first = values[0]
        if all(v == first and type(v) is type(first) for v in values):
            assignments.append(f"{sqlvalues.column(name)} = {mark}")
            params.append(to_db(first))
        else:
            whens = " ".join([f"WHEN %s THEN {mark}"] * len(ids))
            assignments.append(f"{sqlvalues.column(name)} = CASE {qn('id')} {whens} END")
            for i, v in zip(ids, values, strict=True):
                params.extend((i, to_db(v)))
    guard = f"{qn('status')} = %s AND {qn('lease_token')} = %s"
    sql = (
        f"UPDATE {qn(Task._meta.db_table)} SET {', '.join(assignments)} "
        f"WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))}) AND {guard}"
    )
    params.extend(ids)
    params.extend((Status.PROCESSING.value, token))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount
