"""The worker in-process: retries end to end, handler controls, and what a stopping worker hands back."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db.models import F
from django.utils import timezone

import taskflow
from taskflow.engine.attempts import Outcome
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.models import SCHEDULE_LOG_SIZE, ScheduleCfg, Status, Task
from taskflow.runtime.worker import Worker

from .conftest import read_runs, wait_until


@taskflow.handler("test_worker.bad_result")
def bad_result(ctx: Any) -> Any:
    return {"not", "json"}


def finished(task: Task, timeout: float = 30.0) -> Task:
    """Wait for the task to reach a final state and return its row."""
    return wait_until(
        lambda: Task.objects.filter(pk=task.pk, status__in=[Status.SUCCESS, Status.FAILED]).first(), timeout=timeout
    )  # type: ignore[return-value]


def runs_of(run_log: Path, task: Task) -> list[list[str]]:
    """The run log lines of one task: [task_id, attempt, what, worker_id, unix time]."""
    return [r for r in read_runs(run_log) if r[0] == str(task.pk)]


def set_retry_policy(task_type: str, **fields: Any) -> None:
    ScheduleCfg.objects.update_or_create(task_type=task_type, defaults=fields)
    configs.clear()


def test_a_flaky_task_succeeds_on_its_third_attempt(start_worker, run_log: Path) -> None:
    task = taskflow.enqueue("test.flaky", {"succeed_on": 3}, max_retries=3)
    start_worker(["test.flaky"], concurrency=2)

    row = finished(task)

    assert (row.status, row.attempts, row.result, row.status_msg) == (Status.SUCCESS, 3, {"attempt": 3}, "")
    runs = runs_of(run_log, task)
    assert [r[1] for r in runs] == ["1", "2", "3"]
    assert [e["outcome"] for e in row.schedule_log] == ["success", "error", "error"]
    assert "ValueError: not yet" in row.schedule_log[1]["error"]
    # Each retry waited at least its back-off (tests use 0.1 s doubling, up to 10% jitter off).
    times = [float(r[4]) for r in runs]
    assert times[1] - times[0] >= 0.09
    assert times[2] - times[1] >= 0.18


def test_a_failing_task_stops_after_its_retries_with_the_error_and_history(start_worker, run_log: Path) -> None:
    task = taskflow.enqueue("test.fail", max_retries=2)
    start_worker(["test.fail"], concurrency=2)

    row = finished(task)

    assert (row.status, row.attempts) == (Status.FAILED, 3)
    assert [r[1] for r in runs_of(run_log, task)] == ["1", "2", "3"]
    assert row.status_msg.startswith("failed after 3 attempts: RuntimeError: boom on attempt 3")
    assert "Traceback" in row.status_msg
    assert [(e["attempt"], e["outcome"]) for e in row.schedule_log] == [(3, "error"), (2, "error"), (1, "error")]
    assert row.finished_at is not None and row.lease_expires_at is None


def test_the_schedule_log_keeps_only_the_last_six_attempts(start_worker, run_log: Path) -> None:
    set_retry_policy("test.fail", retry_strategy="fixed", retry_interval=0.0, retry_jitter=0.0)
    task = taskflow.enqueue("test.fail", max_retries=7)
    start_worker(["test.fail"], concurrency=1)

    row = finished(task)

    assert len(runs_of(run_log, task)) == 8
    assert len(row.schedule_log) == SCHEDULE_LOG_SIZE == 6
    assert [e["attempt"] for e in row.schedule_log] == [8, 7, 6, 5, 4, 3]
    assert row.schedule_log[0]["error"] == "RuntimeError: boom on attempt 8"


def test_a_snooze_does_not_use_up_an_attempt_and_a_checkpoint_survives_it(start_worker, run_log: Path) -> None:
    task = taskflow.enqueue("test.control", {"action": "snooze", "delay": 0}, max_retries=0)
    start_worker(["test.control"], concurrency=2)

    row = finished(task)

    # max_retries=0 would fail a second counted attempt: both runs were attempt 1.
    assert [r[1] for r in runs_of(run_log, task)] == ["1", "1"]
    assert (row.status, row.attempts) == (Status.SUCCESS, 1)
    assert row.checkpoint == "snoozed" and row.result["checkpoint"] == "snoozed"
    assert [e["outcome"] for e in row.schedule_log] == ["success", "snooze"]


def test_fail_is_permanent_whatever_retries_remain(start_worker, run_log: Path) -> None:
    task = taskflow.enqueue("test.control", {"action": "fail"}, max_retries=5)
    start_worker(["test.control"], concurrency=2)

    row = finished(task)

    assert (row.status, row.attempts, row.status_msg) == (Status.FAILED, 1, "no point retrying")
    assert len(runs_of(run_log, task)) == 1


def test_next_stage_requeues_with_its_stage_and_context_and_fresh_attempts(start_worker, run_log: Path) -> None:
    task = taskflow.enqueue("test.control", {"action": "stages"}, max_retries=0)
    start_worker(["test.control"], concurrency=2)

    row = finished(task)

    assert [r[1] for r in runs_of(run_log, task)] == ["1", "1"]
    assert (row.status, row.stage, row.context, row.attempts) == (Status.SUCCESS, "second", {"from": "first"}, 1)
    assert row.result == {"stage": "second", "context": {"from": "first"}, "checkpoint": None}
    assert [e["outcome"] for e in row.schedule_log] == ["success", "next_stage"]


def test_a_result_that_is_not_json_is_an_error(start_worker) -> None:
    task = taskflow.enqueue("test_worker.bad_result", max_retries=0)
    start_worker(["test_worker.bad_result"], concurrency=1)

    row = finished(task)

    assert row.status == Status.FAILED
    assert "result must be JSON-serialisable" in row.status_msg


def test_an_attempt_taken_away_mid_run_writes_nothing_and_the_task_runs_again(start_worker, run_log: Path) -> None:
    task = taskflow.enqueue("test.heartbeat", {"seconds": 0.6, "every": 0.05})
    start_worker(["test.heartbeat"], concurrency=1)
    wait_until(lambda: runs_of(run_log, task))
    # What the watcher's rescue does; the handler's next heartbeat raises LeaseLost.
    Task.objects.filter(pk=task.pk).update(status=Status.PENDING, lease_token=F("lease_token") + 1)

    row = finished(task)

    runs = runs_of(run_log, task)
    assert [(r[1], r[2]) for r in runs] == [("1", "start"), ("2", "start"), ("2", "end")]
    assert (row.status, row.attempts, row.lease_token) == (Status.SUCCESS, 2, 3)
    # The lost attempt left no trace in the row's history.
    assert [(e["attempt"], e["outcome"]) for e in row.schedule_log] == [(2, "success")]


def test_a_worker_refuses_types_without_a_handler(db) -> None:
    with pytest.raises(taskflow.UnknownTaskType):
        Worker(["test_worker.nobody_handles_this"])


@pytest.mark.django_db
def test_a_stopping_worker_hands_back_claimed_tasks_it_has_not_started(run_log: Path) -> None:
    task = taskflow.enqueue("test.record", {"n": 1})
    [held] = claim_batch(configs.get("test.record"), 1, "w1")
    worker = Worker(["test.record"], concurrency=1)
    worker.request_stop()

    report = worker.execute(held)  # a job reaching a handler thread after the stop was requested

    assert report.outcome == Outcome.HANDBACK
    assert finish_attempts([report], cfgs={"test.record": configs.get("test.record")}) == [report]
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.attempts, row.worker_id, row.schedule_log) == (Status.PENDING, 0, "", [])
    assert not run_log.exists()


def test_a_limited_type_claims_again_when_its_slots_free_not_at_its_next_poll(start_worker) -> None:
    # A limit of 2 and a poll every 10 minutes: only slots this worker frees can start the other tasks.
    ScheduleCfg.objects.update_or_create(
        task_type="test.record", defaults={"concurrency_limit": 2, "schedule_interval": 600.0}
    )
    configs.clear()
    tasks = taskflow.enqueue_many([{"task_type": "test.record", "payload": {"n": i, "sleep": 0.05}} for i in range(8)])
    start_worker(["test.record"], concurrency=4)
    for task in tasks:
        assert finished(task, timeout=30).status == Status.SUCCESS


@pytest.mark.django_db
def test_a_claim_starts_what_the_worker_would_start_right_after_it_and_reserves_the_rest() -> None:
    ScheduleCfg.objects.update_or_create(task_type="test.record", defaults={"schedule_interval": 60.0})
    configs.clear()
    # Due times a millisecond apart: claim order is theirs (tasks of one due time come in no promised order).
    start = timezone.now() - timedelta(minutes=1)
    specs = [
        {"task_type": "test.record", "payload": {"n": i}, "run_after": start + timedelta(milliseconds=i)}
        for i in range(10)
    ]
    tasks = taskflow.enqueue_many(specs)
    worker = Worker(["test.record"], concurrency=1, burst=True)  # a burst worker looks at once
    # One free thread, six ahead of it, of which the worker would start three at once (START_AHEAD).
    claimed, reserved, _ = worker.connector._claim_round(1, 1, False, ahead=6, start_ahead=3)
    assert [t.id for t in claimed] == [t.pk for t in tasks[:7]]  # in claim order
    assert reserved == claimed[4:]
    rows = Task.objects.in_bulk([t.id for t in claimed])
    # Started by the claim itself (no start UPDATE to come): the thread's and the three ahead of it.
    assert all(rows[t.id].started_at is not None for t in claimed[:4])
    assert all(rows[t.id].started_at is None for t in reserved)
    assert {(r.status, r.attempts, r.lease_token) for r in rows.values()} == {(Status.PROCESSING, 1, 1)}
