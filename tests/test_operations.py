"""Operator operations: terminate, retry_now, reschedule, set_priority, set_max_retries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import taskflow
from taskflow.engine import operations
from taskflow.engine.attempts import Outcome, Report, heartbeat
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.transitions import order_time
from taskflow.exceptions import NextStage
from taskflow.models import Status, Task, TaskEvent

T = "test.noop"
pytestmark = pytest.mark.django_db


def state(task: Task) -> tuple[str, int]:
    task.refresh_from_db()
    return task.status, task.attempts


def claim(n: int = 1, task_type: str = T) -> list:
    return claim_batch(configs.get(task_type), n, "w1")


def fail_now(task: Task) -> None:
    """Run one attempt of `task` that fails for good (other due tasks are handed back untouched)."""
    held = claim(100, task.task_type)
    reports = [Report(t, Outcome.FAIL if t.id == task.id else Outcome.HANDBACK, error="broken") for t in held]
    assert len(finish_attempts(reports)) == len(held) and task.id in {t.id for t in held}


# -- terminate -------------------------------------------------------------------------------------------


def test_terminate_stops_pending_tasks_skips_finished_ones_and_records_who_and_why() -> None:
    pending = taskflow.enqueue(T, {"n": 1})
    done = taskflow.enqueue(T, {"n": 2})
    fail_now(done)

    result = taskflow.terminate([pending.id, done.id], by="alice", reason="bad batch")

    assert (result.changed, result.skipped) == (1, {"already finished": 1})
    pending.refresh_from_db()
    assert pending.status == Status.STOPPED and pending.finished_at is not None
    assert pending.status_msg == "stopped by alice: bad batch"
    [event] = TaskEvent.objects.all()
    assert (event.task_id, event.actor, event.action, event.reason) == (pending.id, "alice", "terminate", "bad batch")
    assert event.changes["status"] == ["pending", "stopped"]


def test_terminate_of_a_running_task_fences_its_attempt() -> None:
    task = taskflow.enqueue(T, {})
    [held] = claim()

    result = taskflow.terminate(Task.objects.filter(pk=task.pk), by="bob", reason="stuck")

    assert result.changed == 1
    task.refresh_from_db()
    assert task.status == Status.STOPPED and task.lease_token == held.lease_token + 1
    assert task.schedule_log[0]["outcome"] == "terminated"
    # The attempt's late writes are refused: its heartbeat raises, its report changes nothing.
    with pytest.raises(taskflow.LeaseLost):
        heartbeat(held)
    assert finish_attempts([Report(held, Outcome.SUCCESS, result={"late": True})]) == []
    task.refresh_from_db()
    assert task.status == Status.STOPPED and task.result is None
    assert TaskEvent.objects.get(task_id=task.id).changes == {"status": ["processing", "stopped"]}


def test_a_dry_run_counts_and_changes_nothing() -> None:
    tasks = [taskflow.enqueue(T, {"n": i}) for i in range(3)]
    fail_now(tasks[2])
    before = list(Task.objects.order_by("id").values())

    result = taskflow.terminate(Task.objects.all(), by="carol", dry_run=True)

    assert (result.changed, result.skipped, result.dry_run) == (2, {"already finished": 1}, True)
    assert list(Task.objects.order_by("id").values()) == before
    assert not TaskEvent.objects.exists()


def test_retry_and_reschedule_leave_a_running_task_running() -> None:
    # Their reason for skipping it ("running") once read as terminate's "end the attempt" decision.
    task = taskflow.enqueue(T, {})
    [held] = claim()

    for call in (
        lambda dry_run: taskflow.retry_now([task.id], by="x", dry_run=dry_run),
        lambda dry_run: taskflow.reschedule([task.id], run_after=60, by="x", dry_run=dry_run),
    ):
        for dry_run in (True, False):
            result = call(dry_run)
            assert (result.changed, result.skipped) == (0, {"running": 1})
    task.refresh_from_db()
    assert (task.status, task.lease_token) == (Status.PROCESSING, held.lease_token)
    assert not TaskEvent.objects.exists()


# -- retry_now -------------------------------------------------------------------------------------------


def test_retry_now_revives_failed_tasks_with_a_fresh_budget_and_runs_delayed_ones_now() -> None:
    failed = taskflow.enqueue(T, {}, max_retries=0)
    fail_now(failed)
    delayed = taskflow.enqueue(T, {}, run_after=3600)
    due = taskflow.enqueue(T, {})

    result = taskflow.retry_now([failed.id, delayed.id, due.id], by="dave")

    assert (result.changed, result.skipped) == (2, {"already due": 1})
    failed.refresh_from_db()
    assert (failed.status, failed.attempts, failed.finished_at) == (Status.PENDING, 0, None)
    assert failed.run_after <= timezone.now() and failed.schedule_log[0]["outcome"] == "fail"  # log kept
    delayed.refresh_from_db()
    assert delayed.run_after <= timezone.now()
    assert {t.id for t in claim(10)} == {failed.id, delayed.id, due.id}


def test_retry_now_refuses_a_superseded_version() -> None:
    old = taskflow.enqueue(T, {}, key="doc", version=1, max_retries=0)
    fail_now(old)
    taskflow.enqueue(T, {}, key="doc", version=2)

    result = taskflow.retry_now([old.id], by="erin")

    assert (result.changed, result.skipped) == (0, {"superseded": 1})
    assert state(old) == (Status.FAILED, 1)


# -- reschedule, priority, max retries -----------------------------------------------------------------


def test_reschedule_moves_pending_and_revives_stopped_tasks() -> None:
    pending = taskflow.enqueue(T, {}, priority=10)
    stopped = taskflow.enqueue(T, {})
    taskflow.terminate([stopped.id], by="x")
    when = timezone.now() + timedelta(hours=2)

    result = taskflow.reschedule([pending.id, stopped.id], run_after=when, by="frank", reason="after the deploy")

    assert result.changed == 2
    for task in (pending, stopped):
        task.refresh_from_db()
        assert (task.status, task.run_after) == (Status.PENDING, when)
    aging = configs.get(T).priority_aging
    assert pending.order_time == when - timedelta(seconds=10 * aging)  # the scheduling key follows
    assert claim(10) == []


def test_set_priority_reorders_pending_tasks_and_keeps_it_for_running_ones() -> None:
    first = taskflow.enqueue(T, {"n": 1})
    second = taskflow.enqueue(T, {"n": 2})
    running = taskflow.enqueue("test.record", {})
    claim(1, "test.record")

    assert taskflow.set_priority([second.id, running.id], priority=50, by="gina").changed == 2

    [top] = claim(1)
    assert top.id == second.id  # jumped ahead of the older task
    running.refresh_from_db()
    assert (running.status, running.priority) == (Status.PROCESSING, 50)
    assert first.id in {t.id for t in claim(5)}


def test_out_of_range_values_raise_and_change_nothing() -> None:
    task = taskflow.enqueue(T, {})
    for call in (
        lambda: taskflow.set_priority([task.id], priority=101, by="h"),
        lambda: taskflow.set_max_retries([task.id], max_retries=-1, by="h"),
        lambda: taskflow.reschedule([task.id], run_after="tomorrow", by="h"),
        # A time no database can store (past year 9999), and NaN, are refused like any bad value.
        lambda: taskflow.reschedule([task.id], run_after=1e20, by="h"),
        lambda: taskflow.reschedule([task.id], run_after=float("nan"), by="h"),
        lambda: taskflow.reschedule([task.id], run_after=timedelta(days=999_999_999), by="h"),
        lambda: taskflow.terminate([task.id], by=""),
        lambda: taskflow.terminate(["not-an-id"], by="h"),
    ):
        with pytest.raises(taskflow.InvalidTask):
            call()
    assert state(task) == (Status.PENDING, 0) and not TaskEvent.objects.exists()


@pytest.mark.parametrize("state", ["due", "delayed", "running", "failed", "stopped", "success"])
def test_applicable_names_exactly_the_operations_a_dry_run_would_change(state: str) -> None:
    task = taskflow.enqueue(T, {}, max_retries=0, run_after=3600 if state == "delayed" else None)
    if state == "running":
        claim()
    elif state == "stopped":
        taskflow.terminate([task.id], by="x")
    elif state in ("failed", "success"):
        held = claim()
        finish_attempts([Report(held[0], Outcome.FAIL if state == "failed" else Outcome.SUCCESS)])
    task.refresh_from_db()
    values = {"reschedule": {"run_after": 60}, "set_priority": {"priority": 5}, "set_max_retries": {"max_retries": 7}}

    offered = operations.applicable(task)

    for name in ("terminate", "retry_now", "reschedule", "set_priority", "set_max_retries"):
        dry = getattr(taskflow, name)([task.id], by="x", dry_run=True, **values.get(name, {}))
        # A finished success's priority would be stored, but no attempt will ever use it: not offered.
        expected = dry.changed == 1 and not (name == "set_priority" and state == "success")
        assert (name in offered) == expected, name


def test_set_max_retries_skips_successes() -> None:
    done = taskflow.enqueue(T, {})
    [held] = claim()
    finish_attempts([Report(held, Outcome.SUCCESS)])
    task = taskflow.enqueue(T, {})

    result = taskflow.set_max_retries([task.id, done.id], max_retries=9, by=User(username="ivan"))

    assert (result.changed, result.skipped) == (1, {"succeeded": 1})
    task.refresh_from_db()
    assert task.max_retries == 9
    assert TaskEvent.objects.get().actor == "ivan"


# -- batches and races -------------------------------------------------------------------------------------


def test_a_large_selection_is_changed_in_batches_of_at_most_1000() -> None:
    taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(2500)])

    with CaptureQueriesContext(connection) as queries:
        result = taskflow.terminate(Task.objects.filter(task_type=T), by="bulk", reason="cleanup")

    assert result.changed == 2500
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 3
    assert Task.objects.filter(status=Status.STOPPED).count() == 2500
    assert TaskEvent.objects.count() == 2500


def test_unknown_ids_are_reported_as_not_found() -> None:
    task = taskflow.enqueue(T, {})
    result = taskflow.terminate([task.id, 12345], by="j")
    assert (result.changed, result.skipped) == (1, {"not found": 1})


def test_a_worker_report_landing_first_wins_over_terminate(monkeypatch: pytest.MonkeyPatch) -> None:
    task = taskflow.enqueue(T, {})
    [held] = claim()
    real_finish = operations.finish_attempts

    def report_first(reports, **kwargs):  # noqa: ANN001, ANN003, ANN202
        # The worker's report commits between the operation's read and its write.
        assert finish_attempts([Report(held, Outcome.SUCCESS, result={"ok": True})]) != []
        return real_finish(reports, **kwargs)

    monkeypatch.setattr(operations, "finish_attempts", report_first)
    result = taskflow.terminate([task.id], by="k")

    assert (result.changed, result.skipped) == (0, {"changed meanwhile": 1})
    task.refresh_from_db()
    assert (task.status, task.result) == (Status.SUCCESS, {"ok": True})
    assert not TaskEvent.objects.exists()


def test_a_claim_landing_first_wins_over_retry_now(monkeypatch: pytest.MonkeyPatch) -> None:
    task = taskflow.enqueue(T, {}, run_after=60)
    real_update = operations.sql.update_tasks_expecting

    def claimed_first(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        Task.objects.filter(pk=task.pk).update(run_after=timezone.now())
        assert [t.id for t in claim()] == [task.id]
        return real_update(*args, **kwargs)

    monkeypatch.setattr(operations.sql, "update_tasks_expecting", claimed_first)
    result = taskflow.retry_now([task.id], by="l")

    assert (result.changed, result.skipped) == (0, {"changed meanwhile": 1})
    assert state(task) == (Status.PROCESSING, 1)


# -- operator changes to a running task -------------------------------------------------------------------


def test_set_max_retries_on_a_running_task_judges_that_attempts_failure() -> None:
    task = taskflow.enqueue(T, {})
    [held] = claim()
    assert taskflow.set_max_retries([task.id], max_retries=0, by="gina").changed == 1

    finish_attempts([Report(held, Outcome.ERROR, error="boom")])

    task.refresh_from_db()
    assert (task.status, task.max_retries) == (Status.FAILED, 0)
    assert task.status_msg.startswith("failed after 1 attempts: boom")


@pytest.mark.parametrize("outcome", [Outcome.ERROR, Outcome.NEXT_STAGE])
def test_set_priority_on_a_running_task_is_kept_by_its_report(outcome: Outcome) -> None:
    task = taskflow.enqueue(T, {}, max_retries=5)
    [held] = claim()
    assert taskflow.set_priority([task.id], priority=1, by="gina").changed == 1

    step = NextStage("second") if outcome == Outcome.NEXT_STAGE else None
    finish_attempts([Report(held, outcome, error="boom", next_stage=step)])

    task.refresh_from_db()
    assert (task.status, task.priority) == (Status.PENDING, 1)
    cfg = configs.get(T)
    assert task.order_time == order_time(task.run_after, 1, cfg.priority_aging)  # its queue place too


def test_set_priority_on_a_task_held_by_a_worker_moves_it_when_handed_back() -> None:
    task = taskflow.enqueue(T, {})
    [held] = claim()
    taskflow.set_priority([task.id], priority=1, by="gina")

    finish_attempts([Report(held, Outcome.HANDBACK)])

    task.refresh_from_db()
    assert (task.status, task.priority) == (Status.PENDING, 1)
    assert task.order_time == order_time(task.run_after, 1, configs.get(T).priority_aging)


def test_a_next_stage_with_its_own_priority_still_sets_it_over_an_operators() -> None:
    task = taskflow.enqueue(T, {})
    [held] = claim()
    taskflow.set_priority([task.id], priority=1, by="gina")
    step = NextStage("second", priority=7)

    finish_attempts([Report(held, Outcome.NEXT_STAGE, next_stage=step)])

    task.refresh_from_db()
    assert (task.status, task.stage, task.priority) == (Status.PENDING, "second", 7)
