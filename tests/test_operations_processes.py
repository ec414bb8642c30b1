"""Terminating a running task in a real worker process: the handler is told, its result refused, its slot freed."""

from __future__ import annotations

import time

import pytest

import taskflow
from taskflow.engine import limiter
from taskflow.engine.configs import configs
from taskflow.models import ScheduleCfg, Status, Task, TaskEvent

from .conftest import read_runs, wait_until

pytestmark = [pytest.mark.processes, pytest.mark.django_db(transaction=True)]
T = "test.until_stopped"


def test_terminate_tells_a_running_handler_refuses_its_result_and_frees_its_slot(spawn, run_log) -> None:  # noqa: ANN001
    ScheduleCfg.objects.update_or_create(task_type=T, defaults={"concurrency_limit": 1})
    configs.clear()
    task = taskflow.enqueue(T, {"seconds": 60})
    worker = spawn("taskworker", "--types", T, "--concurrency", "2")
    wait_until(lambda: any(what == "start" for _, _, what, *_ in read_runs(run_log)), timeout=60)

    asked = time.monotonic()
    result = taskflow.terminate([task.id], by="ops", reason="runaway")
    assert result.changed == 1

    # With Redis the notice arrives by pub/sub, without it at the worker's next liveness beat (0.5 s here).
    wait_until(lambda: any(what == "noticed" for _, _, what, *_ in read_runs(run_log)), timeout=10)
    noticed_after = time.monotonic() - asked
    print(f"handler saw stop_requested {noticed_after:.2f}s after terminate")
    assert noticed_after < 5

    time.sleep(1.0)  # its late report has been refused by now
    task.refresh_from_db()
    assert (task.status, task.result) == (Status.STOPPED, None)
    assert task.status_msg == "stopped by ops: runaway"
    assert TaskEvent.objects.filter(task_id=task.id, action="terminate").count() == 1

    # The slot came back at once: a second task of the limited type runs while the worker lives on.
    limiter.reconcile_counters()
    if limiter.held_slots(T) is not None:
        assert limiter.held_slots(T) == 0
    second = taskflow.enqueue(T, {"seconds": 0})
    wait_until(lambda: Task.objects.get(pk=second.pk).status == Status.SUCCESS, timeout=30)
    assert worker.poll() is None
