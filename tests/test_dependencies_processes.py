"""Dependencies with real worker and taskwatch processes: a diamond in order, failure down the graph,
"run" anyway, and a worker killed (-9) between a dependency's success and its dependents' release."""

from __future__ import annotations

from pathlib import Path

import pytest

import taskflow
from taskflow.engine import locks
from taskflow.models import Status, Task, TaskDependency
from taskflow.runtime.leadership import LEADER_LOCK

from .conftest import read_runs, wait_until

pytestmark = pytest.mark.processes


def finished(*tasks: Task) -> bool:
    return Task.objects.filter(
        pk__in=[t.pk for t in tasks], status__in=["success", "failed", "stopped"]
    ).count() == len(tasks)


def rows(*tasks: Task) -> list[Task]:
    by_id = Task.objects.in_bulk([t.pk for t in tasks])
    return [by_id[t.pk] for t in tasks]


def runs_of(run_log: Path) -> dict[str, list[float]]:
    """Task id -> the times its handler started."""
    out: dict[str, list[float]] = {}
    for task_id, _attempt, _what, _worker, at in read_runs(run_log):
        out.setdefault(task_id, []).append(float(at))
    return out


def ran_in_order(run_log: Path, a: Task, b: Task, c: Task, d: Task) -> None:
    """Each handler started after everything its task waits for had finished.

    Compared on one clock (this host's): a handler's own start time (the run log) against the
    reporter's `finished_at` of its dependencies. (A claim stamps `started_at` with the time its
    transaction began, which may precede a release that committed just before its SELECT.)
    """
    started = {task_id: times[0] for task_id, times in runs_of(run_log).items()}
    assert started[str(b.pk)] > a.finished_at.timestamp() and started[str(c.pk)] > a.finished_at.timestamp()
    assert started[str(d.pk)] > max(b.finished_at, c.finished_at).timestamp()


def diamond(task_type: str, on_failure: str = "stop", **a_options: object) -> tuple[Task, Task, Task, Task]:
    a = taskflow.enqueue(task_type, {"sleep": 0.3}, **a_options)
    b = taskflow.enqueue("test.record", {"sleep": 0.2}, depends_on=[a.id], on_dependency_failure=on_failure)
    c = taskflow.enqueue("test.record", {"sleep": 0.4}, depends_on=[a.id], on_dependency_failure=on_failure)
    d = taskflow.enqueue("test.record", {}, depends_on=[b.id, c.id], on_dependency_failure=on_failure)
    return a, b, c, d


def test_a_diamond_runs_in_order_on_real_workers(spawn, run_log) -> None:  # noqa: ANN001
    a, b, c, d = diamond("test.record")
    spawn("taskworker", "--types", "test.record", "--concurrency", "4")
    spawn("taskworker", "--types", "test.record", "--concurrency", "4")
    wait_until(lambda: finished(a, b, c, d), timeout=90)

    a, b, c, d = rows(a, b, c, d)
    assert [t.status for t in (a, b, c, d)] == [Status.SUCCESS] * 4
    assert [t.attempts for t in (a, b, c, d)] == [1, 1, 1, 1]
    # Each started only after everything it waits for had finished (the database's own stamps).
    ran_in_order(run_log, a, b, c, d)
    runs = runs_of(run_log)
    assert [len(runs[str(t.pk)]) for t in (a, b, c, d)] == [1, 1, 1, 1]
    assert runs[str(a.pk)][0] < min(runs[str(b.pk)][0], runs[str(c.pk)][0]) <= runs[str(d.pk)][0]


def test_a_failing_dependency_stops_the_rest_of_the_diamond(spawn, run_log) -> None:  # noqa: ANN001
    a, b, c, d = diamond("test.fail", max_retries=1)
    spawn("taskworker", "--types", "test.fail,test.record", "--concurrency", "4")
    wait_until(lambda: finished(a, b, c, d), timeout=90)

    a, b, c, d = rows(a, b, c, d)
    assert [t.status for t in (a, b, c, d)] == [Status.FAILED, Status.STOPPED, Status.STOPPED, Status.STOPPED]
    assert a.attempts == 2
    assert b.status_msg.startswith(f"dependency {a.pk} failed (failed after 2 attempts: RuntimeError")
    assert c.status_msg.startswith(f"dependency {a.pk} failed")
    assert d.status_msg in (
        f"dependency {b.pk} was stopped (dependency {a.pk} failed)",
        f"dependency {c.pk} was stopped (dependency {a.pk} failed)",
    )
    assert [t.attempts for t in (b, c, d)] == [0, 0, 0]
    assert set(runs_of(run_log)) == {str(a.pk)}  # none of them ran


def test_on_dependency_failure_run_runs_them_after_the_failure(spawn, run_log) -> None:  # noqa: ANN001
    a, b, c, d = diamond("test.fail", on_failure="run", max_retries=0)
    spawn("taskworker", "--types", "test.fail,test.record", "--concurrency", "4")
    wait_until(lambda: finished(a, b, c, d), timeout=90)

    a, b, c, d = rows(a, b, c, d)
    assert [t.status for t in (a, b, c, d)] == [Status.FAILED, Status.SUCCESS, Status.SUCCESS, Status.SUCCESS]
    ran_in_order(run_log, a, b, c, d)
    runs = runs_of(run_log)
    assert all(len(runs[str(t.pk)]) == 1 for t in (a, b, c, d))


def test_a_worker_killed_between_a_success_and_the_release_leaves_nothing_stuck(spawn, run_log) -> None:  # noqa: ANN001
    a, b, c, d = diamond("test.record")
    # This worker kill -9s itself right after A's success is committed, before releasing B and C
    # (tests/taskapp/apps.py: the release is replaced by the kill).
    doomed = spawn(
        "taskworker", "--types", "test.record", "--concurrency", "2", env={"TASKFLOW_TEST_KILL_BEFORE_RELEASE": "1"}
    )
    assert doomed.wait(timeout=90) == -9

    a, b, c, d = rows(a, b, c, d)
    assert [t.status for t in (a, b, c, d)] == [Status.SUCCESS, Status.WAITING, Status.WAITING, Status.WAITING]
    assert TaskDependency.objects.filter(depends_on_id=a.pk, outcome="").count() == 2

    # A worker alone does not look for such tasks; taskwatch's repair duty finds them.
    spawn("taskworker", "--types", "test.record", "--concurrency", "4")
    spawn("taskwatch")
    wait_until(lambda: locks.holder(LEADER_LOCK), timeout=60)
    wait_until(lambda: finished(b, c, d), timeout=90)

    a, b, c, d = rows(a, b, c, d)
    assert [t.status for t in (a, b, c, d)] == [Status.SUCCESS] * 4
    ran_in_order(run_log, a, b, c, d)
    runs = runs_of(run_log)
    assert all(len(runs[str(t.pk)]) == 1 for t in (a, b, c, d))  # A ran once: its success was kept
    assert not TaskDependency.objects.filter(outcome="").exists()


def test_terminate_of_a_waiting_task_with_a_worker_running(spawn, run_log) -> None:  # noqa: ANN001
    a, b, c, d = diamond("test.record")
    taskflow.terminate([c.id], by="ops", reason="not this time")
    spawn("taskworker", "--types", "test.record", "--concurrency", "4")
    wait_until(lambda: finished(a, b, c, d), timeout=90)

    a, b, c, d = rows(a, b, c, d)
    assert [t.status for t in (a, b, c, d)] == [Status.SUCCESS, Status.SUCCESS, Status.STOPPED, Status.STOPPED]
    assert d.status_msg == f"dependency {c.pk} was stopped (stopped by ops: not this time)"
    assert set(runs_of(run_log)) == {str(a.pk), str(b.pk)}
