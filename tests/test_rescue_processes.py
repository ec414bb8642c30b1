"""Rescue with real worker and taskwatch processes: kill -9, stuck handlers, long heartbeating tasks."""

from __future__ import annotations

import time

import pytest
from django.conf import settings

import taskflow
from taskflow.engine import locks
from taskflow.engine.configs import configs
from taskflow.engine.limiter import Limiter, held_slots
from taskflow.models import ScheduleCfg, Status, Task, WorkerProcess
from taskflow.runtime.leadership import LEADER_LOCK

from .conftest import read_runs, wait_until

pytestmark = pytest.mark.processes
TIMINGS = settings.TASKFLOW


def _cfg(task_type: str, **changes: object) -> None:
    configs.get(task_type)
    ScheduleCfg.objects.filter(pk=task_type).update(**changes)


def _outcomes(task: Task) -> list[str]:
    return [entry["outcome"] for entry in Task.objects.get(pk=task.pk).schedule_log]


def test_kill_9_worker_is_rescued_within_the_liveness_timeout_and_finishes_once(spawn, run_log):
    _cfg("test.sleep", max_processing_time=600, concurrency_limit=1)
    doomed = spawn("taskworker", "--types", "test.sleep", "--concurrency", "2")
    spawn("taskwatch")
    wait_until(lambda: locks.holder(LEADER_LOCK) and WorkerProcess.objects.exists(), timeout=60)
    task = taskflow.enqueue("test.sleep", {"seconds": 3})
    (started,) = wait_until(lambda: read_runs(run_log), timeout=60)
    doomed_id = started[3]
    # Started only now, so the task cannot be its; it is up by the time the rescue comes.
    spawn("taskworker", "--types", "test.sleep", "--concurrency", "2")
    doomed.kill()
    doomed.wait(timeout=10)
    killed_at = time.monotonic()
    wait_until(lambda: "rescued" in _outcomes(task), timeout=60, interval=0.02)
    rescue_seconds = time.monotonic() - killed_at
    print(f"\nrescue after kill -9: {rescue_seconds:.2f}s (LIVENESS_TIMEOUT {TIMINGS['LIVENESS_TIMEOUT']}s)")

    # Noticed by liveness, not by the 600 s deadline; and not before the worker's beat went stale.
    liveness = TIMINGS["LIVENESS_TIMEOUT"]
    assert liveness - TIMINGS["HEARTBEAT_INTERVAL"] - 0.5 < rescue_seconds < liveness + 10
    wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.SUCCESS, timeout=60)
    task.refresh_from_db()
    assert task.attempts == 2
    assert task.worker_id != doomed_id
    assert _outcomes(task) == ["success", "rescued"]
    runs = read_runs(run_log)
    assert [(r[0], r[2]) for r in runs].count((str(task.pk), "end")) == 1
    assert [r[3] for r in runs if r[2] == "end"] == [task.worker_id]
    if Limiter().uses_redis:
        # Given back by the rescue and by the survivor's report (and checked by reconciliation).
        wait_until(lambda: held_slots("test.sleep") == 0, timeout=10)


def test_handler_stuck_forever_ends_failed_after_max_retries_plus_one_attempts(spawn, run_log):
    task = taskflow.enqueue("test.sleep", timeout=1, max_retries=2)
    worker = spawn("taskworker", "--types", "test.sleep", "--concurrency", "4")
    spawn("taskwatch")
    wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.FAILED, timeout=90)

    task.refresh_from_db()
    assert task.attempts == 3
    assert task.status_msg.startswith("failed after 3 attempts")
    assert _outcomes(task) == ["rescued"] * 3
    starts = [r for r in read_runs(run_log) if r[0] == str(task.pk)]
    assert [r[1] for r in starts] == ["1", "2", "3"] and {r[2] for r in starts} == {"start"}
    # The worker replaced its stuck threads instead of dying or stalling.
    assert worker.poll() is None
    followup = taskflow.enqueue("test.sleep", {"seconds": 0})
    wait_until(lambda: Task.objects.get(pk=followup.pk).status == Status.SUCCESS, timeout=30)


def test_heartbeating_task_outlives_its_max_processing_time(spawn, run_log):
    _cfg("test.heartbeat", max_processing_time=1)
    task = taskflow.enqueue("test.heartbeat", {"seconds": 4, "every": 0.2})
    spawn("taskworker", "--types", "test.heartbeat")
    spawn("taskwatch")
    wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.SUCCESS, timeout=60)

    task.refresh_from_db()
    assert task.attempts == 1
    assert _outcomes(task) == ["success"]
    assert [r[2] for r in read_runs(run_log)] == ["start", "end"]


def test_worker_with_too_many_stuck_handlers_exits_non_zero(spawn, run_log):
    for _ in range(2):
        taskflow.enqueue("test.sleep", timeout=1)
    worker = spawn("taskworker", "--types", "test.sleep", "--concurrency", "1")
    code = worker.wait(timeout=90)
    assert code != 0
    output = open(worker.log_path).read()
    assert "stuck past their deadlines" in output and "Traceback" not in output  # one readable line
    assert len(read_runs(run_log)) == 2
