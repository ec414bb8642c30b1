"""Task dependencies: a task enqueued with `depends_on` waits until every task it names has succeeded.

Such a task is created `waiting` (never claimed) with one TaskDependency edge per dependency. The
transition that finishes a dependency releases its dependents: once its attempt's final status is
committed, `release` turns each waiting dependent whose dependencies have all succeeded `pending`,
and stops one whose dependency failed or was stopped (naming that dependency in its status message),
which in turn releases that task's own dependents, down the graph. A task enqueued with
`on_dependency_failure="run"` runs once its dependencies have all finished, however they finished.
Every change of a dependent is one guarded UPDATE expecting `waiting`, so two releases racing
for one task (its two dependencies finishing together, the watcher's repair) change it once.

No cycle can form: a task's dependencies must exist when it is enqueued, and its edges are written
only then, so every edge points from a task that is being created to tasks that already existed;
no existing task can wait for it. The one exception, a failed or stopped keyed task re-enqueued in
place (same id), may not be given dependencies while other tasks depend on it.

A crash between a dependency's final write and its release (kill -9, a lost connection) leaves
edges open (`outcome` empty) whose dependency is finished; `repair_waiting`, a watcher duty, finds
them by the open-edge index and runs the same release.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, transaction
from django.utils import timezone

from ..exceptions import InvalidTask
from ..models import Status, Task, TaskDependency
from . import endings, rolling, sql, wakeup
from .configs import configs
from .transitions import order_time
from .validation import MAX_BIGINT

if TYPE_CHECKING:
    from .enqueueing import TaskSpec

log = logging.getLogger("taskflow.dependencies")

MAX_DEPENDENCIES = 1000  # per task: one enqueue reads them all
BATCH = 500  # tasks per release statement and per repair batch: short locks, bounded memory
FINISHED = frozenset({Status.SUCCESS, Status.FAILED, Status.STOPPED})
MISSING = "missing"  # an edge's outcome when its dependency's row is gone (deleted by hand, say)
BROKEN = frozenset({Status.FAILED, Status.STOPPED, MISSING})
ON_FAILURE = ("stop", "run")
WAITING_MESSAGE = "waiting for its dependencies"

KeepGoing = Callable[[], bool]


def _always() -> bool:
    return True


# -- validation (every entry point passes its input through these) ------------------------------------


def validate_depends_on(value: Any) -> tuple[int, ...]:
    """The dependency ids of a request, in order and without repeats.

    Tasks, integers and strings of digits are accepted: the API sends 64-bit ids as strings, as
    JavaScript cannot hold them as numbers.
    """
    if value is None:
        return ()
    if isinstance(value, (str, bytes, int, dict)) or not isinstance(value, Iterable):
        raise InvalidTask(f"depends_on must be a list of task ids; got {value!r}")
    ids: dict[int, None] = {}
    for item in value:
        task_id = item.pk if isinstance(item, Task) else item
        if isinstance(task_id, str) and task_id.isascii() and task_id.isdigit():
            task_id = int(task_id)
        if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 < task_id <= MAX_BIGINT:
            raise InvalidTask(f"depends_on must hold task ids (positive 64-bit integers); got {item!r}")
        ids[task_id] = None
    if len(ids) > MAX_DEPENDENCIES:
        raise InvalidTask(f"depends_on may name at most {MAX_DEPENDENCIES} tasks; got {len(ids)}")
    return tuple(ids)


def validate_on_failure(value: Any) -> bool:
    """Whether `on_dependency_failure` says "run" (else "stop", the default)."""
    if value is None:
        return False
    if value not in ON_FAILURE:
        raise InvalidTask(f"on_dependency_failure must be one of {', '.join(ON_FAILURE)}; got {value!r}")
    return value == "run"


# -- deciding a dependent's status --------------------------------------------------------------------


Edge = tuple[int, str | None, bool]  # (dependency id, its final status or None while unfinished, run_on_failure)


def verdict(edges: Sequence[Edge], messages: dict[int, str]) -> tuple[str, str]:
    """The status a dependent takes and its status message, from its edges; `messages` are the dependencies'.

    Stopped if a dependency it may not run without failed, was stopped or is gone; else waiting
    while any is unfinished; else pending.
    """
    broken = sorted((dep, outcome) for dep, outcome, run in edges if outcome in BROKEN and not run)
    if broken:
        dep, outcome = broken[0]
        return Status.STOPPED, failure_message(dep, outcome, messages.get(dep, ""))
    if any(outcome is None for _, outcome, _ in edges):
        return Status.WAITING, WAITING_MESSAGE
    failed = sorted((dep, outcome) for dep, outcome, _ in edges if outcome in BROKEN)
    if failed:
        dep, outcome = failed[0]
        return Status.PENDING, f"running although {failure_message(dep, outcome, messages.get(dep, ''))}"
    return Status.PENDING, ""


def failure_message(dep: int, outcome: str | None, dep_message: str) -> str:
    """ "dependency 12 failed", with the root cause when the dependency was itself stopped by one."""
    if outcome == MISSING:
        return f"dependency {dep} no longer exists"
    verb = "failed" if outcome == Status.FAILED else "was stopped"
    cause = (dep_message or "").strip().splitlines()[0][:200] if dep_message.strip() else ""
    if cause.startswith("dependency "):
        # Stopped by a dependency itself: name the root of the cascade, not every step of it.
        step, _, inner = cause.partition(" (")
        cause = inner[:-1] if inner.startswith("dependency ") and inner.endswith(")") else step
    return f"dependency {dep} {verb}" + (f" ({cause})" if cause else "")


def _outcome(status: str | None) -> str | None:
    """An edge's outcome from its dependency's status as read (None: not found)."""
    if status is None:
        return MISSING
    return status if status in FINISHED else None


# -- enqueueing ----------------------------------------------------------------------------------------


def plan(specs: Sequence[TaskSpec]) -> dict[int, tuple[str, str]]:
    """Check the specs' dependencies exist and set each spec's initial status; returns what was read.

    Raises InvalidTask, before anything is written, for unknown ids. A dependency that already
    finished counts at once: all succeeded makes the task pending, a failed one stops it (unless
    "run"). The returned {id: (status, status_msg)} is what `record_edges` records.
    """
    wanted = sorted({dep for spec in specs for dep in spec.depends_on})
    if not wanted:
        return {}
    found = _statuses(wanted)
    unknown = [dep for dep in wanted if dep not in found]
    if unknown:
        shown = ", ".join(map(str, unknown[:10])) + (" ..." if len(unknown) > 10 else "")
        raise InvalidTask(f"depends_on names unknown task id(s): {shown}")
    messages = {dep: msg for dep, (_, msg) in found.items()}
    for spec in specs:
        if spec.depends_on:
            edges = [(dep, _outcome(found[dep][0]), spec.run_on_dependency_failure) for dep in spec.depends_on]
            spec.status, spec.status_msg = verdict(edges, messages)
    return found


def refuse_cycle(task_id: int, spec: TaskSpec) -> None:
    """Refuse dependencies for a task re-enqueued in place (same id) while other tasks depend on it."""
    if task_id in spec.depends_on:
        raise InvalidTask(f"task {task_id} cannot depend on itself")
    if spec.depends_on and TaskDependency.objects.filter(depends_on_id=task_id).exists():
        raise InvalidTask(
            f"task {task_id} is re-enqueued in place and other tasks depend on it: it cannot be given "
            "dependencies (they could form a cycle)"
        )


def record_edges(
    created: Sequence[tuple[Task, TaskSpec]], replaced: Sequence[int], read: dict[int, tuple[str, str]]
) -> None:
    """Write the edges of tasks just created, and drop those of tasks re-enqueued in place (same transaction)."""
    if replaced:
        TaskDependency.objects.filter(task_id__in=replaced).delete()
    edges = [
        TaskDependency(
            task_id=task.pk,
            depends_on_id=dep,
            run_on_failure=spec.run_on_dependency_failure,
            outcome=_outcome(read[dep][0]) or "",
        )
        for task, spec in created
        for dep in spec.depends_on
    ]
    if edges:
        TaskDependency.objects.bulk_create(edges, batch_size=BATCH)


def check_after_commit(created: Sequence[tuple[Task, TaskSpec]], read: dict[int, tuple[str, str]]) -> None:
    """Once the enqueue commits, release what a dependency finishing meanwhile could not see yet.

    A dependency read unfinished may finish before our edges commit, and its release would miss
    them; reading it again after our commit closes that window (either it saw our edges or we see it finished).
    """
    unfinished = {
        dep
        for task, spec in created
        if task.status == Status.WAITING
        for dep in spec.depends_on
        if read[dep][0] not in FINISHED
    }
    if unfinished:
        transaction.on_commit(lambda: _release_quietly(_finished_now(unfinished)))


# -- the release ---------------------------------------------------------------------------------------


def release_on_commit(task_ids: Iterable[int]) -> None:
    """After the current transaction commits (at once outside one), release the dependents of these finished tasks."""
    ids = list(task_ids)
    if ids:
        transaction.on_commit(lambda: _release_quietly(ids))


def _release_quietly(task_ids: list[int]) -> None:
    # Runs after a commit, often in a worker's report flush: a failure here must not undo or
    # repeat that report. Nothing is lost: the edges stay open and the watcher's repair releases them.
    try:
        release(task_ids)
    except DatabaseError as exc:
        log.warning("releasing the dependents of %d task(s) failed (%s); taskwatch will repair it", len(task_ids), exc)
    except Exception:
        log.exception("releasing the dependents of %d task(s) failed; taskwatch will repair it", len(task_ids))


def release(task_ids: Iterable[int], now: datetime | None = None) -> int:
    """Release the waiting dependents of these tasks (unfinished ones are ignored); returns the dependents changed.

    Dependents stopped here release their own dependents in the next round, down the graph. Each
    round is one transaction per batch: edges are marked resolved with the dependents' changes, so
    a crash leaves either both or neither.
    """
    frontier = sorted(set(task_ids))
    total = 0
    while frontier:
        stopped: list[int] = []
        for start in range(0, len(frontier), BATCH):
            changed, batch_stopped = _release_round(frontier[start : start + BATCH], now or timezone.now())
            total += changed
            stopped += batch_stopped
        frontier = sorted(set(stopped))
    return total


def _release_round(dependency_ids: list[int], now: datetime) -> tuple[int, list[int]]:
    """One round of `release`: returns (dependents changed, dependents stopped)."""
    # The common case (a task nobody waits for) costs this one indexed read.
    open_edges = list(
        TaskDependency.objects.filter(depends_on_id__in=dependency_ids, outcome="").values_list(
            "depends_on_id", "task_id"
        )
    )
    if not open_edges:
        return 0, []
    read = _statuses(sorted({dep for dep, _ in open_edges}))
    finished = {dep: _outcome(read.get(dep, (None, ""))[0]) for dep, _ in open_edges}
    finished = {dep: outcome for dep, outcome in finished.items() if outcome is not None}
    dependents = sorted({task_id for dep, task_id in open_edges if dep in finished})
    changed, stopped = 0, []
    for start in range(0, len(dependents), BATCH):
        chunk_changed, chunk_stopped = _decide(dependents[start : start + BATCH], finished, read, now)
        changed += chunk_changed
        stopped += chunk_stopped
    return changed, stopped


def _decide(
    dependents: list[int], finished: dict[int, str], read: dict[int, tuple[str, str]], now: datetime
) -> tuple[int, list[int]]:
    """Decide these dependents of `finished` tasks and resolve their edges from them, in one transaction."""
    with transaction.atomic():
        edges_of: dict[int, list[TaskDependency]] = defaultdict(list)
        for edge in TaskDependency.objects.filter(task_id__in=dependents):
            edges_of[edge.task_id].append(edge)
        others = {e.depends_on_id for edges in edges_of.values() for e in edges if not e.outcome} - set(read)
        read = {**read, **_statuses(sorted(others))}
        messages = {dep: msg for dep, (_, msg) in read.items()}
        # Locked as read: the due time written below is computed from run_after and priority, which
        # an operator's reschedule or set_priority may change while the task waits.
        rows = {
            row["id"]: row
            for row in Task.objects.select_for_update()
            .filter(id__in=dependents, status=Status.WAITING)
            .values("id", "task_type", "run_after", "priority")
        }
        waiting = {task_id: row["task_type"] for task_id, row in rows.items()}
        cfgs = configs.get_many(set(waiting.values()))
        writes: dict[int, dict[str, Any]] = {}
        for task_id in sorted(waiting):
            edges = [
                (e.depends_on_id, e.outcome or _outcome(read.get(e.depends_on_id, (None, ""))[0]), e.run_on_failure)
                for e in edges_of[task_id]
            ]
            status, message = verdict(edges, messages)
            if status == Status.STOPPED:
                writes[task_id] = {"status": status, "status_msg": message, "finished_at": now, "updated_at": now}
            elif status == Status.PENDING:
                writes[task_id] = {
                    "status": status,
                    "status_msg": message,
                    **released_due_time(rows[task_id], cfgs[waiting[task_id]].priority_aging, now),
                    "updated_at": now,
                }
        # One guarded UPDATE expecting `waiting`: a dependent released or terminated meanwhile is left alone.
        written = (
            sql.update_tasks_expecting(sql.task_table(), writes, dict.fromkeys(writes, Status.WAITING), now)
            if writes
            else set()
        )
        # Only the edges decided here: an edge committed since it was read stays open for its own
        # enqueue's check (or the repair), or its task could be left waiting with no open edge.
        by_outcome: dict[str, list[int]] = defaultdict(list)
        for dep, outcome in finished.items():
            by_outcome[outcome].append(dep)
        for outcome, deps in by_outcome.items():
            TaskDependency.objects.filter(depends_on_id__in=deps, task_id__in=dependents, outcome="").update(
                outcome=outcome
            )
        wakeup.notify_on_commit({waiting[i] for i in written if writes[i]["status"] == Status.PENDING})
        stopped = [i for i in written if writes[i]["status"] == Status.STOPPED]
        endings.announce_finished((i, waiting[i]) for i in stopped)
    return len(written), stopped


def released_due_time(row: dict[str, Any], aging: float, now: datetime) -> dict[str, Any]:
    """A released task's due time: counted from its release, never earlier than the run_after it was given.

    Its pending timeout and priority aging count from then too: while it waited it could not run.
    """
    run_after = max(row["run_after"], now)
    return {"run_after": run_after, "order_time": order_time(run_after, row["priority"], aging)}


def _statuses(ids: Sequence[int]) -> dict[int, tuple[str, str]]:
    """{id: (status, status_msg)} of the tasks found among `ids`, in the task table or a history table."""
    found = rolling.find_tasks(ids, ("status", "status_msg"))
    return {task_id: (row["status"], row["status_msg"]) for task_id, row in found.items()}


def _finished_now(ids: Iterable[int]) -> list[int]:
    """Those of `ids` finished now, or gone, once any end of theirs being written has committed.

    The read locks the rows: a report whose UPDATE found none of our edges (so it releases no one,
    see finishing.py) and has not committed yet is waited for, and its end seen here.
    """
    ids = sorted(set(ids))
    with transaction.atomic():
        hot = dict(Task.objects.select_for_update().filter(id__in=ids).order_by("id").values_list("id", "status"))
    missing = [i for i in ids if i not in hot]
    return sorted(
        [i for i, status in hot.items() if status in FINISHED] + (_finished_among(missing) if missing else [])
    )


def _finished_among(ids: Iterable[int]) -> list[int]:
    """Those of `ids` finished now, or gone."""
    ids = sorted(set(ids))
    read = _statuses(ids)
    return [i for i in ids if _outcome(read.get(i, (None, ""))[0]) is not None]


# -- the watcher's repair ------------------------------------------------------------------------------


def repair_waiting(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Release dependents a crash left waiting: open edges whose dependency has finished (or is gone).

    Walks the open edges in dependency order through their index, BATCH dependencies at a time;
    normally the open edges are those of tasks still waiting, so this reads little.
    """
    total = 0
    after = 0
    while keep_going():
        ids = list(
            TaskDependency.objects.filter(outcome="", depends_on_id__gt=after)
            .order_by("depends_on_id")
            .values_list("depends_on_id", flat=True)
            .distinct()[:BATCH]
        )
        if not ids:
            break
        after = ids[-1]
        finished = _finished_among(ids)
        if finished:
            total += release(finished, now)
        if len(ids) < BATCH:
            break
    if total:
        log.info("released %d task(s) left waiting for finished dependencies", total)
    return total


# -- operator operations -------------------------------------------------------------------------------


def revival_blockers(task_ids: Sequence[int]) -> set[int]:
    """Those of these (finished) tasks that may not run again: a dependency has not succeeded now.

    A dependency that finished otherwise blocks only tasks enqueued with on_dependency_failure="stop".
    Retrying a task does not retry its dependencies; retry those first.
    """
    if not task_ids:
        return set()
    edges = list(
        TaskDependency.objects.filter(task_id__in=task_ids).values_list(
            "task_id", "depends_on_id", "run_on_failure", "outcome"
        )
    )
    if not edges:
        return set()
    read = _statuses(sorted({dep for _, dep, _, _ in edges}))
    blocked = set()
    for task_id, dep, run, outcome in edges:
        # A dependency gone with a dropped history table counts as the edge recorded it.
        status = read.get(dep, (outcome if outcome in FINISHED else None, ""))[0]
        if status == Status.SUCCESS or (run and _outcome(status) is not None):
            continue
        blocked.add(task_id)
    return blocked


# -- the console ---------------------------------------------------------------------------------------


def neighbours(task_id: int, limit: int = 50) -> dict[str, list[dict[str, Any]]]:
    """A task's dependencies and dependents (up to `limit` each), with their current status ("missing" if gone)."""
    dependencies = list(
        TaskDependency.objects.filter(task_id=task_id)
        .order_by("depends_on_id")
        .values("depends_on_id", "run_on_failure")[:limit]
    )
    dependents = list(
        TaskDependency.objects.filter(depends_on_id=task_id)
        .order_by("task_id")
        .values("task_id", "run_on_failure")[:limit]
    )
    ids = [e["depends_on_id"] for e in dependencies] + [e["task_id"] for e in dependents]
    rows = rolling.find_tasks(ids, ("task_type", "status"))

    def entry(other: int, run: bool) -> dict[str, Any]:
        row = rows.get(other, {})
        return {
            "id": other,
            "task_type": row.get("task_type", ""),
            "status": row.get("status", MISSING),
            "run_on_failure": run,
        }

    return {
        "dependencies": [entry(e["depends_on_id"], e["run_on_failure"]) for e in dependencies],
        "dependents": [entry(e["task_id"], e["run_on_failure"]) for e in dependents],
    }
