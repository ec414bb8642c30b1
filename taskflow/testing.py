"""Helpers for testing code that uses taskflow: run due tasks in-process, assert what was enqueued, eager mode.

`run_tasks()` claims due tasks, runs their handlers and reports their ends through the engine, in
the calling thread and on the test's own database connection, until nothing is due: retries,
stages, snoozes, dependencies, paused types and concurrency limits behave as with `taskworker`.
`eager()` makes every task that becomes due run at once, once the transaction that made it due
commits (Django's ImmediateBackend, Celery's eager mode). `enqueued()` and `assert_enqueued()`
look at what is in the task table.

Inside a test case's transaction (pytest-django's `db`, Django's `TestCase`) nothing ever commits,
so these helpers treat the test's own transaction as absent while they run: a callback registered
with `transaction.on_commit` runs when the code's own outermost transaction commits, or at once
outside one, as it would in production. That is what releases dependents and frees limit slots.

Also a pytest plugin (loaded by the `pytest11` entry point): the `taskflow_eager` and
`taskflow_tasks` fixtures. See docs/testing-your-tasks.md.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from .engine.attempts import Report
    from .models import Task

__all__ = [
    "Attempt",
    "Tasks",
    "TooManyAttempts",
    "assert_enqueued",
    "assert_not_enqueued",
    "eager",
    "enqueued",
    "run_tasks",
]

ANY: Any = object()  # "any payload" in enqueued() and the assertions
_state = threading.local()  # per thread: the run in progress (`runs`), the eager listener (`eager`)


class TooManyAttempts(AssertionError):
    """run_tasks() reached its `limit`: a task that keeps requeueing itself (a snooze loop, say)?"""


@dataclass(frozen=True)
class Attempt:
    """One attempt run_tasks() ran, and what its report made of the task."""

    task_id: int
    task_type: str
    attempt: int  # 1 for the first attempt (ctx.attempt)
    stage: str
    outcome: str  # success, error (retried while attempts remain), fail, snooze, next_stage, lost
    status: str | None  # the task's status once the report was written; None if it was refused
    result: Any = None
    error: str = ""  # "ValueError: …" for an attempt that failed, the reason of a fail or snooze
    traceback: str = ""

    def task(self) -> Task:
        """The task as it is now."""
        from .engine.rolling import get_task

        return get_task(self.task_id)


def run_tasks(
    task_types: Iterable[str] | None = None,
    *,
    scheduled: bool = False,
    limit: int = 1000,
) -> list[Attempt]:
    """Run due tasks in this thread until none is due; returns the attempts run, in order.

    `task_types`: those to run, as `taskworker --types` takes them (default: what `taskworker`
    serves, every handler and every `django.tasks` function). Tasks they make due (a retry
    without delay, a next stage, a released dependent, a task a handler enqueues) run too.
    `scheduled=True` also runs what is due later, earliest first, as if the clock jumped to it:
    retries after their back-off, snoozed and delayed tasks. More than `limit` attempts raise
    TooManyAttempts. Call it outside your code's own transactions, as a worker would run.
    """
    from django.utils import timezone

    from .engine import registry
    from .engine.configs import configs
    from .runtime.worker import Worker

    types = _served(task_types)
    if not types:
        return []
    configs.clear()  # settings changed by the test itself (a limit, a pause) apply now
    # The worker's own handling of an attempt (its context, signals, errors and log records).
    worker = Worker(types, concurrency=1, burst=True, worker_id="taskflow.testing")
    ran: list[Attempt] = []
    ahead = timedelta(0)  # how far scheduled=True moved the clock
    runs: list[set[str]] = _thread_value("runs", list)
    also: set[str] = set()  # types that became due meanwhile (see _EagerListener)
    runs.append(also)
    try:
        with _commits_in_tests():
            while True:
                now = timezone.now() + ahead
                types += sorted((also - set(types)) & set(registry.registered_types()))
                claimed = _claim(worker, types, now)
                if not claimed:
                    later = _next_due(types, now) if scheduled else None
                    if later is None:
                        return ran
                    ahead += later - now
                    continue
                if len(ran) + len(claimed) > limit:
                    raise TooManyAttempts(f"run_tasks ran {len(ran)} attempts and more are due: {_summary(ran)}")
                ran += _run(worker, claimed, ahead)
    finally:
        runs.pop()


def _served(task_types: Iterable[str] | None) -> list[str]:
    """The task types named (django.tasks module paths too), or all that taskworker serves by default."""
    from .runtime.django_tasks import select_task_types

    return select_task_types(list(task_types or ()), [])


def _claim(worker: Any, types: list[str], now: datetime) -> list[Any]:
    """Claim due tasks of these types as a worker's claim round does (paused types skipped, limits held)."""
    from .engine.claiming import claim_within_limit
    from .engine.configs import configs

    claimed = []
    for _, cfg in sorted(configs.get_many(types).items()):
        if cfg.paused:
            continue
        limit = cfg.schedule_limit
        claimed += claim_within_limit(cfg, limit, worker.worker_id, worker.limiter, host=worker.host, now=now)
    return claimed


def _run(worker: Any, claimed: list[Any], ahead: timedelta) -> list[Attempt]:
    """Run each claimed attempt's handler and write its end, one report at a time (as it finishes)."""
    from django.utils import timezone

    from .engine.finishing import finish_attempts

    ran = []
    for task in claimed:
        report: Report = worker.execute(task)
        finish_attempts([report], limiter=worker.limiter, now=timezone.now() + ahead)
        ran.append(_attempt(report))
    return ran


def _attempt(report: Report) -> Attempt:
    task = report.task
    return Attempt(
        task_id=task.id,
        task_type=task.task_type,
        attempt=task.attempt,
        stage=task.stage,
        outcome=str(report.outcome),
        status=report.written.get("status") if report.written is not None else None,
        result=report.result,
        error=report.error,
        traceback=report.detail,
    )


def _next_due(types: list[str], now: datetime) -> datetime | None:
    from django.db.models import Min

    from .models import Status, Task

    pending = Task.objects.filter(task_type__in=types, status=Status.PENDING, run_after__gt=now)
    return pending.aggregate(at=Min("run_after"))["at"]


def _summary(ran: list[Attempt]) -> str:
    tail = ", ".join(f"{a.task_type}#{a.task_id} attempt {a.attempt} {a.outcome}" for a in ran[-5:])
    return f"the last were {tail}" if ran else "none ran"


# -- eager mode -------------------------------------------------------------------------------------


@contextlib.contextmanager
def eager(task_types: Iterable[str] | None = None) -> Iterator[None]:
    """While inside, a task that becomes due runs at once in this thread, once its transaction commits.

    An enqueue outside a transaction has run when `enqueue` returns (the Task it returned is as it
    was enqueued: read it again). Tasks due later wait, as for a worker: `run_tasks(scheduled=True)`
    runs them. A task failing is retried by its type's policy, and the retry runs once it is due.
    `task_types`: only these run eagerly (default: all that `taskworker` serves).
    """
    from .engine import wakeup

    listener = _EagerListener(set(task_types) if task_types is not None else None)
    wakeup.add_local_listener(listener)
    try:
        with _commits_in_tests():
            yield
    finally:
        wakeup.remove_local_listener(listener)


class _EagerListener:
    """A wake-up listener (engine/wakeup.py): work became due for these types, so run it now."""

    def __init__(self, task_types: set[str] | None) -> None:
        self.task_types = task_types
        self.thread = threading.get_ident()

    def __call__(self, task_types: set[str]) -> None:
        if threading.get_ident() != self.thread:
            return  # another thread's work (a worker running in this process): not this test's
        wanted = set(_served(self.task_types))
        due = (task_types or wanted) & wanted
        if not due:
            return
        runs: list[set[str]] = _thread_value("runs", list)
        if runs:
            runs[-1].update(due)  # a run in progress (this wake-up came from it) picks them up
            return
        run_tasks(due)


# -- a test's transaction as if it were absent --------------------------------------------------


@contextlib.contextmanager
def _commits_in_tests(using: str = "default") -> Iterator[None]:
    """Run on-commit callbacks as if the test case's own transaction were not there (see the module doc)."""
    from django.db import connections

    connection = connections[using]
    if getattr(connection, "_taskflow_commits_in_tests", False):
        yield  # already on (eager mode around run_tasks)
        return
    on_commit, savepoint_commit = connection.on_commit, connection.savepoint_commit

    def only_the_test_case_is_open() -> bool:
        return connection.in_atomic_block and all(getattr(a, "_from_testcase", False) for a in connection.atomic_blocks)

    def patched_on_commit(func: Callable[[], Any], robust: bool = False) -> None:
        if only_the_test_case_is_open():
            _call(func, robust)
        else:
            on_commit(func, robust)

    def patched_savepoint_commit(sid: str) -> None:
        savepoint_commit(sid)
        # Atomic.__exit__ forgets its block before releasing its savepoint: when only the test
        # case's blocks remain, the code's outermost transaction has just "committed".
        if only_the_test_case_is_open():
            due = [entry for entry in connection.run_on_commit if sid in entry[0]]
            connection.run_on_commit = [entry for entry in connection.run_on_commit if sid not in entry[0]]
            for _, func, robust in due:
                _call(func, robust)

    connection.on_commit = patched_on_commit  # type: ignore[method-assign]
    connection.savepoint_commit = patched_savepoint_commit  # type: ignore[method-assign]
    connection._taskflow_commits_in_tests = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _restore(connection)


def _restore(connection: BaseDatabaseWrapper) -> None:
    for name in ("on_commit", "savepoint_commit", "_taskflow_commits_in_tests"):
        connection.__dict__.pop(name, None)


def _call(func: Callable[[], Any], robust: bool) -> None:
    if not robust:
        func()
        return
    try:
        func()
    except Exception:  # as Django runs a robust callback: logged, not raised
        import logging

        logging.getLogger("django.db.backends.base").exception("Error calling %s in on_commit()", func)


def _thread_value(name: str, default: Callable[[], Any]) -> Any:
    if not hasattr(_state, name):
        setattr(_state, name, default())
    return getattr(_state, name)


# -- what was enqueued ------------------------------------------------------------------------------


def enqueued(task_type: str | None = None, *, payload: Any = ANY, **fields: Any) -> list[Task]:
    """The tasks in the task table (any status), oldest first, of `task_type` and matching the rest.

    `payload`: a dict matches every payload holding those keys with those values (nested dicts
    likewise, anything else must be equal). `fields`: Task fields and lookups (`status="pending"`,
    `key="order-42"`, `run_after__gt=…`).
    """
    from .models import Task

    tasks = Task.objects.order_by("id")
    if task_type is not None:
        tasks = tasks.filter(task_type=task_type)
    if fields:
        tasks = tasks.filter(**fields)
    return [task for task in tasks if payload is ANY or _contains(task.payload, payload)]


def assert_enqueued(
    task_type: str, *, payload: Any = ANY, count: int | None = None, **fields: Any
) -> list[Task]:
    """Assert tasks of `task_type` like these were enqueued (`count` of them exactly, if given); returns them."""
    found = enqueued(task_type, payload=payload, **fields)
    if (not found and count is None) or (count is not None and len(found) != count):
        wanted = "no" if count == 0 else (f"{count}" if count is not None else "a")
        what = f"{wanted} {task_type} task(s)" + (f" with payload containing {payload!r}" if payload is not ANY else "")
        what += "".join(f", {name}={value!r}" for name, value in fields.items())
        raise AssertionError(f"expected {what}; found {len(found)}. {_listing(task_type)}")
    return found


def assert_not_enqueued(task_type: str, *, payload: Any = ANY, **fields: Any) -> None:
    """Assert no task of `task_type` like this was enqueued."""
    assert_enqueued(task_type, payload=payload, count=0, **fields)


def _contains(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, dict):
        return isinstance(value, dict) and all(k in value and _contains(value[k], v) for k, v in wanted.items())
    return bool(value == wanted)


def _listing(task_type: str) -> str:
    tasks = enqueued(task_type)
    if not tasks:
        return f"No {task_type} task at all."
    shown = "; ".join(f"#{t.id} [{t.status}] payload={t.payload!r}" for t in tasks[:10])
    return f"The {task_type} tasks: {shown}" + (f" (and {len(tasks) - 10} more)" if len(tasks) > 10 else "")


# -- the pytest plugin ------------------------------------------------------------------------------


class Tasks:
    """The `taskflow_tasks` fixture: this module's functions, for a test that asked for the database."""

    run = staticmethod(run_tasks)
    enqueued = staticmethod(enqueued)
    assert_enqueued = staticmethod(assert_enqueued)
    assert_not_enqueued = staticmethod(assert_not_enqueued)
    eager = staticmethod(eager)


def _forget_cached_configs() -> None:
    # Schedule configs are cached per process; a test's rolled-back rows must not outlive it.
    module = sys.modules.get("taskflow.engine.configs")
    if module is not None:
        module.configs.clear()


try:
    import pytest
except ImportError:  # plain functions only: Django's own test runner, say
    pass
else:

    @pytest.fixture
    def taskflow_tasks(db: None) -> Iterator[Tasks]:
        """run_tasks, enqueued, assert_enqueued, assert_not_enqueued and eager, with the database."""
        _forget_cached_configs()
        yield Tasks()
        _forget_cached_configs()

    @pytest.fixture
    def taskflow_eager(db: None) -> Iterator[None]:
        """Eager mode for the whole test: every task that becomes due runs at once."""
        _forget_cached_configs()
        with eager():
            yield
        _forget_cached_configs()
