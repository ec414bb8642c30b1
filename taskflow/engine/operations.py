"""Operator operations: stop, retry, reschedule and re-prioritise tasks, one or a million at a time.

The console, the API and users' own code call these; each takes a selection (a Task queryset or
task ids), who acts (`by`) and why (`reason`), and returns what it changed and what it skipped,
and why. Every change is one guarded UPDATE per batch of at most BATCH rows, expecting each row's
status (and, for running tasks, its fencing token) as read, so an operation racing a worker never
overwrites the worker's report, and no statement holds long locks. Each changed task gets a
TaskEvent in the same transaction; a dry run writes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from ..exceptions import InvalidTask, TaskStopped, class_path
from ..models import ScheduleCfg, Status, Task, TaskEvent, TaskKey
from . import dependencies, endings, limiter, rolling, sql, wakeup
from .attempts import ClaimedTask, Outcome, Report
from .configs import configs
from .finishing import finish_attempts
from .transitions import order_time
from .validation import MAX_INT, resolve_run_after, validate_non_negative_int, validate_priority

BATCH = 1000  # rows per statement: short locks however large the selection
FINISHED = (Status.SUCCESS, Status.FAILED, Status.STOPPED)

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

Selection = QuerySet[Task] | Iterable[int | str | Task]
# Who acts: a user (its username is recorded) or a name such as "api:ops-bot" or "cron".
type Actor = AbstractBaseUser | str


@dataclass
class OperationResult:
    """What an operation did: how many tasks it changed, and how many it skipped for each reason."""

    action: str
    changed: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def total(self) -> int:
        return self.changed + sum(self.skipped.values())

    def __str__(self) -> str:
        verb = "would change" if self.dry_run else "changed"
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return f"{self.action}: {verb} {self.changed}" + (f"; skipped {skipped}" if skipped else "")


class _EndAttempt:
    """A decision: end the task's running attempt through finish_attempts (terminate)."""


# Not a string: a rule's reason for skipping a task ("running", say) must never read as this decision.
END_ATTEMPT = _EndAttempt()

# A rule looks at one task (as read) and returns the columns to write, why it leaves the task
# alone, or END_ATTEMPT.
Decision = dict[str, Any] | str | _EndAttempt
Rule = Callable[[dict[str, Any], "_Batch"], Decision]


def terminate(selection: Selection, *, by: Actor, reason: str = "", dry_run: bool = False) -> OperationResult:
    """Stop tasks: pending and waiting ones at once; running ones too, fencing their attempt (its writes are refused).

    A running handler is told through `ctx.stop_requested`, and its next heartbeat or checkpoint
    raises LeaseLost; its concurrency slot is given back when it returns or its attempt's deadline
    passes, whichever is first (limiter.py: lingering attempts). Finished tasks are skipped.
    Tasks waiting for a stopped task are stopped too (dependencies.py), down the graph.
    """

    def rule(row: dict[str, Any], batch: _Batch) -> Decision:
        if row["status"] in (Status.PENDING, Status.WAITING):
            return {
                "status": Status.STOPPED,
                "status_msg": _message("stopped", batch.actor, batch.reason),
                "finished_at": batch.now,
            }
        if row["status"] == Status.PROCESSING:
            return END_ATTEMPT
        return "already finished"

    return _operate("terminate", selection, rule, by=by, reason=reason, dry_run=dry_run)


# Why a stopped task is not run again yet: the handler it was stopped in runs on until it returns
# or its attempt's deadline passes.
HANDLER_RUNNING = "its stopped handler still running"


def retry_now(selection: Selection, *, by: Actor, reason: str = "", dry_run: bool = False) -> OperationResult:
    """Run tasks now: failed or stopped ones again with a fresh retry budget, delayed pending ones early.

    The schedule log is kept. A superseded version (a newer one of its key exists) is not retried,
    nor a task with a dependency that has not succeeded (retry that first), nor a task stopped
    while it ran whose handler has neither returned nor reached its deadline; a task waiting for
    its dependencies keeps waiting (reschedule moves the time it runs once released). A task
    rolled into a history table is moved back into the task table and retried there.
    """

    def rule(row: dict[str, Any], batch: _Batch) -> Decision:
        if row["status"] == Status.WAITING:
            return "waiting for dependencies"
        if row["status"] == Status.PENDING:
            if row["run_after"] <= batch.now:
                return "already due"
            if batch.handler_running(row):
                return HANDLER_RUNNING
            return batch.due_at(row, batch.now)
        if row["status"] in (Status.FAILED, Status.STOPPED):
            if batch.superseded(row):
                return "superseded"
            if batch.blocked(row):
                return "dependency not succeeded"
            if batch.handler_running(row):
                return HANDLER_RUNNING
            return {**batch.revived(row, "retried"), **batch.due_at(row, batch.now)}
        return "running" if row["status"] == Status.PROCESSING else "succeeded"

    return _operate("retry_now", selection, rule, by=by, reason=reason, dry_run=dry_run)


def reschedule(
    selection: Selection, *, run_after: datetime | float, by: Actor, reason: str = "", dry_run: bool = False
) -> OperationResult:
    """Move tasks' due time (`run_after`: an aware datetime or seconds from now); failed/stopped ones become pending.

    A waiting task keeps waiting for its dependencies and runs no earlier than `run_after` once released.
    """
    now = timezone.now()
    when = resolve_run_after(run_after, now)

    def rule(row: dict[str, Any], batch: _Batch) -> Decision:
        if batch.handler_running(row):
            return HANDLER_RUNNING
        if row["status"] in (Status.PENDING, Status.WAITING):
            return batch.due_at(row, when)
        if row["status"] in (Status.FAILED, Status.STOPPED):
            if batch.superseded(row):
                return "superseded"
            if batch.blocked(row):
                return "dependency not succeeded"
            if batch.handler_running(row):
                return HANDLER_RUNNING
            return {**batch.revived(row, "rescheduled"), **batch.due_at(row, when)}
        return "running" if row["status"] == Status.PROCESSING else "succeeded"

    return _operate("reschedule", selection, rule, by=by, reason=reason, dry_run=dry_run, now=now)


def set_priority(
    selection: Selection, *, priority: int, by: Actor, reason: str = "", dry_run: bool = False
) -> OperationResult:
    """Set tasks' priority (-100..100); pending ones move in the queue at once, others keep it for later attempts.

    A running attempt's retry, snooze, next stage or hand-back queues the task with the new value
    (finishing.py reads it again under the row lock; a next stage naming its own priority sets that).
    """
    priority = validate_priority(priority)

    def rule(row: dict[str, Any], batch: _Batch) -> Decision:
        if row["priority"] == priority:
            return "unchanged"
        changes: dict[str, Any] = {"priority": priority}
        if row["status"] in (Status.PENDING, Status.WAITING):
            changes["order_time"] = order_time(row["run_after"], priority, batch.cfg(row).priority_aging)
        return changes

    return _operate("set_priority", selection, rule, by=by, reason=reason, dry_run=dry_run)


def set_max_retries(
    selection: Selection, *, max_retries: int, by: Actor, reason: str = "", dry_run: bool = False
) -> OperationResult:
    """Set how many retries tasks get (>= 0); a running attempt's own failure is judged by the new value.

    (finishing.py reads the value again under the row lock when that attempt's failure is written.)
    """
    max_retries = validate_non_negative_int("max_retries", max_retries, maximum=MAX_INT)  # type: ignore[assignment]

    def rule(row: dict[str, Any], batch: _Batch) -> Decision:
        if row["status"] == Status.SUCCESS:
            return "succeeded"
        if row["max_retries"] == max_retries:
            return "unchanged"
        return {"max_retries": max_retries}

    return _operate("set_max_retries", selection, rule, by=by, reason=reason, dry_run=dry_run)


# The operations that can make a finished task run again, with a fresh retry budget (its
# attempts count from 1 again); their TaskEvent records the status it left.
REVIVING = ("retry_now", "reschedule")


def revivals(task_id: int, limit: int) -> list[TaskEvent]:
    """The newest `limit` times an operator made this finished task run again (retry now, reschedule), newest first."""
    return list(
        TaskEvent.objects.filter(task_id=task_id, action__in=REVIVING, changes__has_key="status").order_by(
            "-at", "-id"
        )[:limit]
    )


def applicable(task: Task, now: datetime | None = None) -> list[str]:
    """The operations that can change `task` as it is now, by the rules above (a console's buttons).

    set_priority and set_max_retries are offered while a later attempt can still use the value.
    A dry run has the last word (a superseded version, say, is only found out by it).
    """
    now = now or timezone.now()
    status = task.status
    names = []
    if status in (Status.WAITING, Status.PENDING, Status.PROCESSING):
        names.append("terminate")
    if status in (Status.FAILED, Status.STOPPED) or (status == Status.PENDING and task.run_after > now):
        names.append("retry_now")
    if status in (Status.WAITING, Status.PENDING, Status.FAILED, Status.STOPPED):
        names.append("reschedule")
    if status != Status.SUCCESS:
        names += ["set_priority", "set_max_retries"]
    return names


# -- the machinery shared by every operation ---------------------------------------------------------

# What an operation reads of each task: its state, and enough to build the attempt of a running one.
_COLUMNS = (
    *sql.CLAIM_COLUMNS,
    "status",
    "worker_id",
    "started_at",
    "lease_expires_at",
    "attempts",
    "finished_at",
)


def actor_name(by: Any) -> str:
    """Who acts, as recorded: a user's username, or a name such as "api:ops-bot" or "cron"."""
    name = by.get_username() if hasattr(by, "get_username") else by
    if not isinstance(name, str) or not name.strip():
        raise InvalidTask(f"an operation needs `by`: a user or a non-empty name; got {by!r}")
    return name.strip()[:200]


class _Batch:
    """One batch of tasks being decided: the time, who acts, and per-type configs and key heads."""

    def __init__(self, rows: list[dict[str, Any]], actor: str, reason: str, now: datetime) -> None:
        self.actor, self.reason, self.now = actor, reason, now
        self._cfgs = configs.get_many({row["task_type"] for row in rows})
        keyed = {(row["task_type"], row["key"]) for row in rows if row["key"] is not None}
        self._newest: dict[tuple[str, str], int] = {}
        if keyed:
            types = {t for t, _ in keyed}
            keys = {k for _, k in keyed}
            for task_type, key, version in TaskKey.objects.filter(task_type__in=types, key__in=keys).values_list(
                "task_type", "key", "version"
            ):
                self._newest[(task_type, key)] = version
        self._blocked = dependencies.revival_blockers(
            [row["id"] for row in rows if row["status"] in (Status.FAILED, Status.STOPPED)]
        )
        # Stopped while its handler ran, and that handler has neither returned nor reached its
        # deadline: running the task again now would run it twice at once.
        # A stopped task re-enqueued in place is pending while that handler runs (its due time waits
        # for the handler's deadline): it must not be made due early either.
        self._handler_running = {a.id for a in limiter.lingering_attempts()} if rows else set()

    def handler_running(self, row: dict[str, Any]) -> bool:
        """Whether a handler of this task that an operator stopped may still run (limiter.py: lingering attempts)."""
        return row["id"] in self._handler_running

    def blocked(self, row: dict[str, Any]) -> bool:
        """Whether a finished task may not run again because a dependency of it has not succeeded."""
        return row["id"] in self._blocked

    def cfg(self, row: dict[str, Any]) -> ScheduleCfg:
        return self._cfgs[row["task_type"]]

    def superseded(self, row: dict[str, Any]) -> bool:
        """Whether a newer version of this task's key was accepted (then this one must not run again)."""
        if row["key"] is None:
            return False
        return self._newest.get((row["task_type"], row["key"]), row["version"]) > row["version"]

    def due_at(self, row: dict[str, Any], when: datetime) -> dict[str, Any]:
        aging = self.cfg(row).priority_aging
        return {"run_after": when, "order_time": order_time(when, row["priority"], aging)}

    def revived(self, row: dict[str, Any], verb: str) -> dict[str, Any]:
        """A finished task made pending again, with a fresh retry budget (its schedule log kept)."""
        return {
            "status": Status.PENDING,
            "status_msg": _message(verb, self.actor, self.reason) + f" (was {row['status']})",
            "attempts": 0,
            "finished_at": None,
            "prefer_host": "",
            "prefer_host_until": None,
        }


def _message(verb: str, actor: str, reason: str) -> str:
    return f"{verb} by {actor}" + (f": {reason}" if reason else "")


def _operate(
    action: str,
    selection: Selection,
    rule: Rule,
    *,
    by: Actor,
    reason: str,
    dry_run: bool,
    now: datetime | None = None,
) -> OperationResult:
    actor = actor_name(by)
    if not isinstance(reason, str):
        raise InvalidTask(f"reason must be text; got {reason!r}")
    result = OperationResult(action, dry_run=dry_run)
    skipped: Counter[str] = Counter()
    ids = _selected_ids(selection)
    for start in range(0, len(ids), BATCH):
        batch_ids = ids[start : start + BATCH]
        batch_now = now or timezone.now()
        if dry_run:
            rows = list(rolling.find_tasks(batch_ids, _COLUMNS).values())
            skipped["not found"] += len(batch_ids) - len(rows)
            batch = _Batch(rows, actor, reason, batch_now)
            for row in rows:
                decision = rule(row, batch)
                if isinstance(decision, str):
                    skipped[decision] += 1
                else:
                    result.changed += 1
            continue
        changed, batch_skipped, missing = _apply_batch(action, batch_ids, rule, actor, reason, batch_now)
        result.changed += changed
        skipped.update(batch_skipped)
        skipped["not found"] += missing
    result.skipped = {why: n for why, n in skipped.items() if n}
    return result


def _apply_batch(
    action: str, ids: list[int], rule: Rule, actor: str, reason: str, now: datetime
) -> tuple[int, Counter[str], int]:
    """Decide and write one batch in one transaction; returns (changed, skipped by reason, ids not found).

    The rules see each task wherever it lives; one in a history table that a rule changes is moved
    back into the task table first, in the same transaction (a skipped one stays where it is).
    """
    skipped: Counter[str] = Counter()
    table = sql.task_table()
    due_types: set[str] = set()
    with transaction.atomic():
        rows = list(rolling.find_tasks(ids, _COLUMNS).values())
        batch = _Batch(rows, actor, reason, now)
        writes: dict[int, dict[str, Any]] = {}
        expected: dict[int, str] = {}
        running: list[Report] = []
        by_id = {row["id"]: row for row in rows}
        for row in rows:
            decision = rule(row, batch)
            if decision is END_ATTEMPT:
                running.append(_terminated(row, batch))
            elif isinstance(decision, str):
                skipped[decision] += 1
            else:
                writes[row["id"]] = {**decision, "updated_at": now}
                expected[row["id"]] = row["status"]
        rolled = [i for i in writes if "history_position" in by_id[i]]
        if rolled:
            # Not restored (dropped meanwhile, say): the guarded UPDATE below misses it.
            rolling.restore(rolled, now)
        written = sql.update_tasks_expecting(table, writes, expected, now) if writes else set()
        # A row that changed between our read and our write (a worker's report, a claim) is left alone.
        skipped["changed meanwhile"] += len(writes) - len(written)
        accepted = finish_attempts(running, now=now) if running else []
        stopped = {r.task.id for r in accepted}
        if accepted:
            # Once committed, tell the workers running them (ctx.stop_requested); they would also
            # notice at their next liveness beat.
            fenced = {r.task.id: r.task.lease_token for r in accepted}
            transaction.on_commit(lambda: wakeup.publish_stops(fenced))
        skipped["changed meanwhile"] += len(running) - len(stopped)
        events = [
            TaskEvent(
                task_id=task_id,
                at=now,
                actor=actor,
                action=action,
                reason=reason,
                changes=_diff(by_id[task_id], writes[task_id]),
            )
            for task_id in sorted(written)
        ] + [
            TaskEvent(
                task_id=task_id,
                at=now,
                actor=actor,
                action=action,
                reason=reason,
                changes={"status": [Status.PROCESSING.value, Status.STOPPED.value]},
            )
            for task_id in sorted(stopped)
        ]
        TaskEvent.objects.bulk_create(events)
        # Tasks stopped here release the tasks waiting for them (those ended through
        # finish_attempts are released by it).
        dependencies.release_on_commit(i for i in written if writes[i].get("status") == Status.STOPPED)
        endings.announce_finished(
            (i, by_id[i]["task_type"]) for i in written if writes[i].get("status") == Status.STOPPED
        )
        for task_id in written:
            change, row = writes[task_id], by_id[task_id]
            pending = change.get("status", row["status"]) == Status.PENDING
            if pending and change.get("run_after") is not None and change["run_after"] <= now:
                due_types.add(row["task_type"])
    if due_types:
        wakeup.publish(due_types)
    return len(written) + len(stopped), skipped, len(ids) - len(rows)


def _terminated(row: dict[str, Any], batch: _Batch) -> Report:
    attempt = ClaimedTask.running(row, batch.cfg(row), batch.now)
    reason = _message("stopped", batch.actor, batch.reason)
    return Report(attempt, Outcome.TERMINATED, error=reason, exception=class_path(TaskStopped))


def _diff(row: dict[str, Any], changes: dict[str, Any]) -> dict[str, list[Any]]:
    """{"field": [before, after]} for the fields an operation changed, as JSON."""
    out = {}
    for name, after in changes.items():
        if name in ("updated_at", "order_time"):
            continue
        before = row.get(name)
        if before != after:
            out[name] = [_jsonable(before), _jsonable(after)]
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return value.value if hasattr(value, "value") else value


def _selected_ids(selection: Selection) -> list[int]:
    if isinstance(selection, QuerySet):
        if selection.model is not Task:
            raise InvalidTask(f"a selection is a Task queryset or task ids, not {selection.model.__name__} rows")
        return sorted(selection.order_by().values_list("id", flat=True))
    if isinstance(selection, (str, bytes, int, Task)):
        selection = [selection]  # type: ignore[list-item]
    ids: set[int] = set()
    for item in selection:
        value = item.pk if isinstance(item, Task) else item
        try:
            task_id = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InvalidTask(f"not a task id: {value!r}") from None
        if isinstance(value, bool) or task_id <= 0:
            raise InvalidTask(f"not a task id: {value!r}")
        ids.add(task_id)
    return sorted(ids)
