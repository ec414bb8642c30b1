"""django.tasks on taskflow end to end: tasks enqueued through Django's public API and run by a real
`manage.py taskworker` process (and `taskwatch` for timeouts)."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.db import transaction
from django.tasks import TaskResultStatus
from django.test import Client
from django.utils import timezone

from taskflow.exceptions import AttemptTimedOut
from taskflow.models import Task as TaskRow
from tests.conftest import read_runs, wait_until
from tests.taskapp import djtasks

pytestmark = pytest.mark.processes

R, F, S = TaskResultStatus.RUNNING, TaskResultStatus.FAILED, TaskResultStatus.SUCCESSFUL


def finished(result, timeout: float = 60.0):  # noqa: ANN001, ANN201
    def done() -> bool:
        result.refresh()
        return result.is_finished

    wait_until(done, timeout, interval=0.1)
    return result


def worker_pid(result) -> int:  # noqa: ANN001
    """The process id in the worker id ("host:pid:suffix") of the result's last attempt."""
    return int(result.worker_ids[-1].rsplit(":", 2)[1])


def test_results_of_sync_and_async_functions_round_trip(spawn) -> None:  # noqa: ANN001
    echo = djtasks.echo.enqueue([1, "two"], {"three": 3.0}, key=None, when="now")
    async_echo = djtasks.async_echo.enqueue(7)
    own_id = djtasks.get_task_id.enqueue()
    worker = spawn("taskworker", "--concurrency", "2")
    assert finished(echo).return_value == {"args": [[1, "two"], {"three": 3.0}], "kwargs": {"key": None, "when": "now"}}
    assert finished(async_echo).return_value == {"args": [7], "kwargs": {}, "async": True}
    assert finished(own_id).return_value == own_id.id
    for result in (echo, async_echo, own_id):
        assert result.status == S and result.attempts == 1 and worker_pid(result) == worker.pid
        assert result.enqueued_at <= result.started_at <= result.finished_at
        assert djtasks.echo.backend == result.backend
        # A new lookup sees the same.
        assert result.task.get_result(result.id) == result


def test_failures_are_retried_and_the_final_error_kept(spawn, run_log: Path) -> None:  # noqa: ANN001
    failing = djtasks.failing_task_value_error.enqueue()  # max_retries=2
    flaky = djtasks.flaky_with_context.enqueue(3)  # max_retries=3, succeeds on attempt 3
    spawn("taskworker", "--concurrency", "2")
    failing = finished(failing)
    assert failing.status == F and failing.attempts == 3
    assert [e.exception_class for e in failing.errors] == [ValueError] * 3
    assert failing.errors[-1].traceback.endswith("ValueError: This task failed due to ValueError\n")
    flaky = finished(flaky)
    assert flaky.status == S and flaky.attempts == 3 and flaky.return_value["attempt"] == 3
    assert [str(e.exception_class.__name__) for e in flaky.errors] == ["RuntimeError", "RuntimeError"]
    # context.attempt counted 1, 2, 3 in the worker.
    assert [run[1] for run in read_runs(run_log) if run[0] == flaky.id and run[2] == "flaky"] == ["1", "2", "3"]


def test_a_deferred_task_waits_for_its_time(spawn, run_log: Path) -> None:  # noqa: ANN001
    spawn("taskworker")
    finished(djtasks.noop_task.enqueue())  # the worker is up
    at = timezone.now() + timedelta(seconds=3)
    late = djtasks.record.using(run_after=at).enqueue("late")
    now = finished(djtasks.record.enqueue("now"))
    late = finished(late)
    assert late.task.run_after == at and late.started_at >= at > now.started_at
    assert [run[2] for run in read_runs(run_log) if run[2] in ("late", "now")] == ["now", "late"]


def test_higher_priority_runs_first(spawn, run_log: Path) -> None:  # noqa: ANN001
    results = [djtasks.record.using(priority=p).enqueue(f"p{p}") for p in (-20, 0, 50, 10, -5)]
    spawn("taskworker", "--concurrency", "1")
    for result in results:
        finished(result)
    order = [run[2] for run in read_runs(run_log) if run[2].startswith("p")]
    assert order == ["p50", "p10", "p0", "p-5", "p-20"]


def test_signals_are_sent_in_the_worker_as_djangos_backends_send_them(spawn, run_log: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("TASKFLOW_TEST_LOG", str(run_log))  # task_enqueued is noted in this process
    ok = djtasks.flaky_with_context.enqueue(2)
    bad = djtasks.failing_task_system_exit.enqueue()  # max_retries=0
    spawn("taskworker")
    finished(ok), finished(bad)

    def signals(result) -> list[str]:  # noqa: ANN001
        return [f"{run[1]} {run[2]}" for run in read_runs(run_log) if run[0] == result.id and ":" in run[2]]

    # task_finished goes out just after the end commits.
    wait_until(lambda: all(any("task_finished" in line for line in signals(r)) for r in (ok, bad)))
    # enqueued is sent here (the test's process), the others by the worker; attempts counted in each.
    assert signals(ok) == [
        "0 task_enqueued:READY:TaskflowBackend",
        "1 task_started:RUNNING:TaskflowBackend",
        "2 task_started:RUNNING:TaskflowBackend",
        "2 task_finished:SUCCESSFUL:TaskflowBackend",
    ]
    assert signals(bad) == [
        "0 task_enqueued:READY:TaskflowBackend",
        "1 task_started:RUNNING:TaskflowBackend",
        "1 task_finished:FAILED:TaskflowBackend",
    ]


def test_system_exit_fails_the_task_and_the_worker_goes_on(spawn) -> None:  # noqa: ANN001
    exits = djtasks.failing_task_system_exit.enqueue()
    worker = spawn("taskworker", "--concurrency", "1")
    exits = finished(exits)
    assert exits.status == F and exits.errors[0].exception_class is SystemExit
    after = finished(djtasks.calculate_meaning_of_life.enqueue())
    assert after.return_value == 42 and worker_pid(after) == worker.pid and worker.poll() is None


def test_keyboard_interrupt_fails_the_attempt_and_stops_the_worker(spawn) -> None:  # noqa: ANN001
    interrupted = djtasks.failing_task_keyboard_interrupt.enqueue()  # max_retries=0
    worker = spawn("taskworker", "--concurrency", "1")
    assert worker.wait(timeout=60) == 0  # a graceful stop
    interrupted.refresh()
    assert interrupted.status == F and interrupted.errors[0].exception_class is KeyboardInterrupt


def test_a_timed_out_attempt_fails_with_taskflows_timeout_exception(spawn) -> None:  # noqa: ANN001
    slow = djtasks.sleep_for.enqueue(30)  # timeout=1, max_retries=0
    spawn("taskworker")
    spawn("taskwatch")
    slow = finished(slow)
    assert slow.status == F and slow.attempts == 1
    assert slow.errors[0].exception_class is AttemptTimedOut


def test_queues_select_what_a_worker_runs(spawn) -> None:  # noqa: ANN001
    default = djtasks.calculate_meaning_of_life.enqueue()
    other = djtasks.calculate_meaning_of_life.using(queue_name="other").enqueue()
    worker = spawn("taskworker", "--queues", "other")
    assert finished(other).status == S
    default.refresh()
    assert default.status == TaskResultStatus.READY
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    spawn("taskworker", "--types", "tests.taskapp.djtasks.calculate_meaning_of_life")
    assert finished(default).return_value == 42


def test_a_queue_first_used_after_the_worker_started_is_served(spawn, settings, tmp_path: Path) -> None:  # noqa: ANN001
    """QUEUES: [] allows any queue: a worker started without --types serves a new one without a restart."""
    any_queue = {"default": {"BACKEND": "taskflow.backends.TaskflowBackend", "QUEUES": []}}
    settings.TASKS = any_queue
    package = tmp_path / "anyqueue"
    package.mkdir()
    (package / "anyqueue_settings.py").write_text(f"from tests.settings import *  # noqa\nTASKS = {any_queue!r}\n")
    spawn("taskworker", env={"PYTHONPATH": str(package), "DJANGO_SETTINGS_MODULE": "anyqueue_settings"})
    assert finished(djtasks.calculate_meaning_of_life.enqueue()).status == S  # the worker is up
    fresh = djtasks.calculate_meaning_of_life.using(queue_name="fresh").enqueue()
    assert finished(fresh, timeout=20).return_value == 42


def test_a_rolled_back_enqueue_never_runs(spawn, run_log: Path) -> None:  # noqa: ANN001
    spawn("taskworker")
    with pytest.raises(RuntimeError), transaction.atomic():
        djtasks.record.enqueue("rolled-back")
        raise RuntimeError("the caller's data failed")
    kept = finished(djtasks.record.enqueue("kept"))
    assert kept.status == S
    assert [run[2] for run in read_runs(run_log) if run[2] in ("kept", "rolled-back")] == ["kept"]
    assert TaskRow.objects.count() == 1


def test_a_failed_task_is_retried_from_the_console(spawn) -> None:  # noqa: ANN001
    # Fails its four attempts (max_retries=3); a fifth run (context.attempt 5) succeeds.
    result = djtasks.flaky_with_context.enqueue(5)
    spawn("taskworker")
    assert finished(result).status == F and result.attempts == 4
    operator = User.objects.create_user("olga", password="pw", is_staff=True)
    operator.user_permissions.set(
        Permission.objects.filter(content_type__app_label="taskflow", codename__in=["view_task", "operate_task"])
    )
    client = Client()
    client.force_login(operator)
    response = client.post(
        "/admin/taskflow/task/operate/retry_now/",
        {"select_across": "0", "_selected_action": [result.id], "reason": "fixed upstream", "_confirm": "1"},
    )
    assert response.status_code == 302
    result.refresh()
    assert result.status in (TaskResultStatus.READY, R, S)
    result = finished(result)
    assert result.status == S and result.attempts == 5 and result.return_value["attempt"] == 5
    assert len(result.errors) == 4
