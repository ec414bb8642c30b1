"""Async (`async def`) handlers: run on the worker's event loop, many at once, reported as sync ones are;
cancelled past their deadline, on a stop, and past a shutdown's grace period."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

import taskflow
from taskflow.engine import operations
from taskflow.engine.configs import configs
from taskflow.engine.progress import shown
from taskflow.exceptions import AttemptTimedOut, class_path
from taskflow.models import ScheduleCfg, Status, Task
from tests.conftest import peak_overlap, read_runs, wait_until

SLEEP = "test.async_sleep"
CONTROL = "test.async_control"


def finished(task: Task, timeout: float = 60.0) -> Task:
    final = [Status.SUCCESS, Status.FAILED, Status.STOPPED]
    return wait_until(lambda: Task.objects.filter(pk=task.pk, status__in=final).first(), timeout=timeout)  # type: ignore[return-value]


def logged(run_log: Path, task: Task, what: str) -> list[list[str]]:
    return [r for r in read_runs(run_log) if r[0] == str(task.pk) and r[2] == what]


def set_policy(task_type: str, **fields: Any) -> None:
    ScheduleCfg.objects.update_or_create(task_type=task_type, defaults=fields)
    configs.clear()


def output(proc) -> str:  # noqa: ANN001
    return Path(proc.log_path).read_text()


# -- outcomes, in an in-process worker -----------------------------------------------------------


def test_an_async_handlers_success_and_failure_are_reported_as_a_sync_ones(start_worker) -> None:
    ok = taskflow.enqueue(SLEEP, {"seconds": 0.05})
    failing = taskflow.enqueue(CONTROL, {"action": "raise"}, max_retries=0)
    start_worker([SLEEP, CONTROL], concurrency=1)

    assert (finished(ok).status, finished(ok).result, finished(ok).attempts) == (Status.SUCCESS, {"slept": 0.05}, 1)
    row = finished(failing)
    assert row.status == Status.FAILED
    assert row.status_msg.startswith("failed after 1 attempts: RuntimeError: boom on attempt 1\nTraceback")
    [entry] = row.schedule_log
    assert entry["exception"] == "builtins.RuntimeError" and "in async_control" in entry["traceback"]


def test_an_async_snooze_fail_and_next_stage_are_reported_as_sync_ones(start_worker, run_log: Path) -> None:
    snoozed = taskflow.enqueue(CONTROL, {"action": "snooze", "delay": 0}, max_retries=0)
    failed = taskflow.enqueue(CONTROL, {"action": "fail"}, max_retries=5)
    staged = taskflow.enqueue(CONTROL, {"action": "stages"}, max_retries=0)
    start_worker([CONTROL], concurrency=1)

    row = finished(snoozed)
    assert (row.status, row.attempts, row.checkpoint) == (Status.SUCCESS, 1, "snoozed")
    assert [e["outcome"] for e in row.schedule_log] == ["success", "snooze"]
    row = finished(failed)
    assert (row.status, row.attempts, row.status_msg) == (Status.FAILED, 1, "no point retrying")
    row = finished(staged)
    assert (row.status, row.stage, row.context) == (Status.SUCCESS, "second", {"from": "first"})
    assert [e["outcome"] for e in row.schedule_log] == ["success", "next_stage"]


@pytest.mark.parametrize("action", ["progress", "sync_calls"])
def test_an_async_handlers_progress_and_checkpoint_are_written(start_worker, action: str) -> None:
    """The awaitable variants, and the sync ones called on the loop (written in a thread, not refused by Django)."""
    task = taskflow.enqueue(CONTROL, {"action": action}, max_retries=0)
    start_worker([CONTROL], concurrency=1)

    row = finished(task)
    assert row.status == Status.SUCCESS, row.status_msg
    progress = shown(row.progress, row.lease_token) or {}
    if action == "progress":
        assert (progress.get("done"), progress.get("total"), progress.get("message")) == (3, 4, "three")
    else:
        assert (progress.get("done"), progress.get("total"), progress.get("message")) == (2, 4, "two")
        assert row.checkpoint == {"sync": True}


# -- real worker processes -----------------------------------------------------------------------


@pytest.mark.processes
def test_hundreds_of_async_handlers_run_at_once_in_one_worker_with_two_threads(spawn, run_log: Path) -> None:
    tasks = taskflow.enqueue_many([{"task_type": SLEEP, "payload": {"seconds": 0.5}} for _ in range(300)])
    worker = spawn("taskworker", "--types", SLEEP, "--concurrency", "2", "--burst")
    assert worker.wait(timeout=120) == 0, output(worker)

    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS, attempts=1).count() == 300
    # Far more ran at once than there are threads: each awaited without holding one.
    assert peak_overlap(run_log) >= 50


@pytest.mark.processes
def test_an_async_handler_past_its_deadline_is_cancelled_and_retried_then_failed(spawn, run_log: Path) -> None:
    set_policy(SLEEP, retry_strategy="fixed", retry_interval=0.0, retry_jitter=0.0)
    task = taskflow.enqueue(SLEEP, {}, timeout=1, max_retries=1)  # sleeps forever, never heartbeats
    # No taskwatch: the worker itself cancels the coroutine and reports the timeout.
    worker = spawn("taskworker", "--types", SLEEP, "--concurrency", "1")

    row = finished(task)
    assert (row.status, row.attempts) == (Status.FAILED, 2), output(worker)
    assert [e["exception"] for e in row.schedule_log] == [class_path(AttemptTimedOut)] * 2
    assert "ran past its deadline" in row.status_msg
    assert [r[1] for r in logged(run_log, task, "cancelled")] == ["1", "2"]


@pytest.mark.processes
def test_terminating_a_running_async_task_cancels_its_handler(spawn, run_log: Path) -> None:
    task = taskflow.enqueue(SLEEP, {})
    other = taskflow.enqueue(SLEEP, {"seconds": 0.1}, run_after=2)
    worker = spawn("taskworker", "--types", SLEEP, "--concurrency", "1")
    wait_until(lambda: logged(run_log, task, "start"), timeout=60)

    assert operations.terminate([task.pk], by="op", reason="test").changed == 1
    wait_until(lambda: logged(run_log, task, "cancelled"), timeout=30)
    row = Task.objects.get(pk=task.pk)
    assert row.status == Status.STOPPED and not logged(run_log, task, "end")
    assert finished(other).status == Status.SUCCESS  # the worker runs on
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, output(worker)
    assert Task.objects.get(pk=task.pk).status == Status.STOPPED  # its late report was refused


@pytest.mark.processes
def test_sigterm_lets_running_async_handlers_finish_and_cancels_those_past_the_grace(spawn, run_log: Path) -> None:
    short = [taskflow.enqueue(SLEEP, {"seconds": 1.5}) for _ in range(2)]
    endless = taskflow.enqueue(SLEEP, {})
    worker = spawn("taskworker", "--types", SLEEP, "--concurrency", "1", "--grace", "4")
    wait_until(lambda: len([r for r in read_runs(run_log) if r[2] == "start"]) == 3, timeout=60)

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, output(worker)

    for task in short:
        assert (Task.objects.get(pk=task.pk).status, Task.objects.get(pk=task.pk).attempts) == (Status.SUCCESS, 1)
    row = Task.objects.get(pk=endless.pk)
    # Past the grace period: cancelled, and requeued as a counted, interrupted attempt.
    assert (row.status, row.attempts) == (Status.PENDING, 1)
    assert "interrupted" in row.status_msg
    assert logged(run_log, endless, "cancelled")


@pytest.mark.processes
def test_a_limit_of_three_on_an_async_type_never_has_more_than_three_running(spawn, run_log: Path) -> None:
    set_policy(SLEEP, concurrency_limit=3)
    tasks = taskflow.enqueue_many([{"task_type": SLEEP, "payload": {"seconds": 0.2}} for _ in range(30)])
    workers = [spawn("taskworker", "--types", SLEEP, "--concurrency", "1", "--burst") for _ in range(2)]
    for worker in workers:
        assert worker.wait(timeout=120) == 0, output(worker)

    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS).count() == 30
    assert 2 <= peak_overlap(run_log) <= 3


@pytest.mark.processes
def test_async_django_tasks_run_on_the_workers_event_loop_at_once(spawn) -> None:
    from tests.taskapp import djtasks

    results = [djtasks.async_where.enqueue(0.5) for _ in range(20)]
    with_context = djtasks.async_with_context.enqueue()
    worker = spawn("taskworker", "--concurrency", "1")

    def done() -> bool:
        for result in [*results, with_context]:
            result.refresh()
        return all(r.is_finished for r in [*results, with_context])

    wait_until(done, timeout=60, interval=0.1)
    assert {r.status.name for r in results} == {"SUCCESSFUL"}, output(worker)
    values = [r.return_value for r in results]
    assert {v["thread"] for v in values} == {"taskflow-event-loop"}
    # One thread, yet they all waited together.
    assert max(v["started"] for v in values) < min(v["ended"] for v in values)
    assert (with_context.status.name, with_context.return_value) == ("SUCCESSFUL", 1)
    row = Task.objects.get(pk=int(with_context.id))
    assert (shown(row.progress, row.lease_token) or {}).get("message") == "half"


def test_the_remote_worker_runs_async_handlers_at_once(live_server, run_log: Path, monkeypatch) -> None:  # noqa: ANN001
    from taskflow.runtime.remote import RemoteWorker
    from taskflow.runtime.remote_client import ApiClient
    from tests.conftest import run_in_thread
    from tests.remote_support import api_token

    monkeypatch.setenv("TASKFLOW_TEST_LOG", str(run_log))
    tasks = taskflow.enqueue_many([{"task_type": SLEEP, "payload": {"seconds": 0.5}} for _ in range(40)])
    failing = taskflow.enqueue(CONTROL, {"action": "fail"})
    client = ApiClient(live_server.url + "/api/", api_token("remote-worker", "hold_task"), timeout=5)
    worker = RemoteWorker(client, [SLEEP, CONTROL], concurrency=1, burst=True, poll_interval=0.1, beat_interval=0.3)
    thread, raised = run_in_thread(worker)
    thread.join(timeout=60)
    assert not thread.is_alive() and not raised

    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS, attempts=1).count() == 40
    assert (finished(failing).status, finished(failing).status_msg) == (Status.FAILED, "no point retrying")
    assert peak_overlap(run_log) >= 10


def test_the_banner_shows_the_event_loop_s_capacity_when_async_handlers_are_served(caplog) -> None:
    from taskflow.runtime.worker import Worker

    caplog.set_level("INFO", logger="taskflow.worker")
    Worker([SLEEP, "test.record"], concurrency=2, async_concurrency=50).connector.banner()
    Worker(["test.record"], concurrency=3).connector.banner()
    first, second = [r for r in caplog.records if " starting: " in r.getMessage()]
    assert "concurrency 2, async 50, types test.async_sleep,test.record" in first.getMessage()
    assert first.async_concurrency == 50
    assert "concurrency 3, types test.record" in second.getMessage() and "async" not in second.getMessage()
