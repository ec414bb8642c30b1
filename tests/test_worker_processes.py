"""Real `manage.py taskworker` processes: draining together without duplicates, and stopping without loss."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest

import taskflow
from taskflow.models import Status, Task

from .conftest import read_runs, wait_until

pytestmark = pytest.mark.processes


def output(proc) -> str:  # noqa: ANN001
    return Path(proc.log_path).read_text()


def test_four_workers_drain_two_thousand_tasks_each_exactly_once(spawn, run_log: Path) -> None:
    # A few milliseconds each, so one worker alone cannot drain them all before the others start.
    tasks = taskflow.enqueue_many(
        [{"task_type": "test.record", "payload": {"n": i, "sleep": 0.005}} for i in range(2000)]
    )
    ids = {str(t.pk) for t in tasks}

    procs = [spawn("taskworker", "--types", "test.record", "--concurrency", "4", "--burst") for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=240) == 0, output(proc)

    assert Task.objects.filter(status=Status.SUCCESS, attempts=1).count() == 2000
    runs = read_runs(run_log)
    per_task = Counter(r[0] for r in runs)
    assert set(per_task) == ids
    assert [t for t, n in per_task.items() if n != 1] == []
    # The work really was shared: more than one process ran tasks.
    assert len({r[3] for r in runs}) >= 2


def test_sigterm_lets_running_tasks_finish_and_hands_the_rest_to_the_next_worker(spawn, run_log: Path) -> None:
    tasks = [taskflow.enqueue("test.sleep", {"seconds": 1.5}) for _ in range(6)]
    ids = {str(t.pk) for t in tasks}
    first = spawn("taskworker", "--types", "test.sleep", "--concurrency", "2", "--grace", "10")
    wait_until(lambda: len(read_runs(run_log)) >= 2, timeout=60)

    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0, output(first)

    ran_first = {r[0] for r in read_runs(run_log) if r[2] == "start"}
    assert ran_first and ran_first < ids
    rows = {str(t.pk): t for t in Task.objects.filter(pk__in=[t.pk for t in tasks])}
    assert not [t for t in rows.values() if t.status == Status.PROCESSING]
    # What was running finished; what had not started is pending again, its attempt not counted.
    for task_id in ran_first:
        assert (rows[task_id].status, rows[task_id].attempts) == (Status.SUCCESS, 1)
    for task_id in ids - ran_first:
        assert (rows[task_id].status, rows[task_id].attempts) == (Status.PENDING, 0)

    second = spawn("taskworker", "--types", "test.sleep", "--concurrency", "4", "--burst")
    assert second.wait(timeout=60) == 0, output(second)

    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS, attempts=1).count() == 6
    runs = read_runs(run_log)
    assert Counter(r[0] for r in runs if r[2] == "start") == Counter(dict.fromkeys(ids, 1))
    assert Counter(r[0] for r in runs if r[2] == "end") == Counter(dict.fromkeys(ids, 1))


def test_a_task_still_running_when_the_grace_period_ends_is_requeued_as_a_counted_attempt(spawn, run_log: Path) -> None:
    task = taskflow.enqueue("test.sleep", {})  # sleeps until the process dies
    proc = spawn("taskworker", "--types", "test.sleep", "--concurrency", "1", "--grace", "0.5")
    wait_until(lambda: read_runs(run_log), timeout=60)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, output(proc)

    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.attempts) == (Status.PENDING, 1)
    assert "interrupted" in row.status_msg
    assert [e["outcome"] for e in row.schedule_log] == ["error"]


def test_a_waiting_worker_is_woken_by_redis_not_its_poll(spawn, redis_client, run_log: Path) -> None:
    """With a 60 s poll interval, only the on-commit wake-up can start a task within seconds."""
    from taskflow.engine.configs import configs
    from taskflow.models import ScheduleCfg, WorkerProcess

    configs.get("test.record")
    ScheduleCfg.objects.filter(pk="test.record").update(schedule_interval=60)
    proc = spawn("taskworker", "--types", "test.record", "--concurrency", "2")
    wait_until(lambda: WorkerProcess.objects.exists(), timeout=60)
    wait_until(lambda: "starting" in output(proc), timeout=30)
    import time

    time.sleep(1.0)  # past its first poll: from now on it polls again only after 60 s

    task = taskflow.enqueue("test.record", {"n": 1})
    wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.SUCCESS, timeout=10)
    started = Task.objects.get(pk=task.pk).started_at
    assert (started - task.created_at).total_seconds() < 10
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, output(proc)
