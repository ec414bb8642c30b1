"""taskflow.testing: run_tasks() through the engine, eager mode after commit, assertions on what was enqueued."""

from __future__ import annotations

import pytest
from django.db import transaction

import taskflow
from taskflow.models import ScheduleCfg, Status, Task
from taskflow.testing import (
    Tasks,
    TooManyAttempts,
    assert_enqueued,
    assert_not_enqueued,
    eager,
    enqueued,
    run_tasks,
)

pytestmark = pytest.mark.django_db


@taskflow.handler("testing.greet")
def greet(ctx: taskflow.TaskContext) -> dict[str, str]:
    return {"greeting": f"hello {ctx.payload['name']}"}


@taskflow.handler("testing.flaky")
def flaky(ctx: taskflow.TaskContext) -> int:
    if ctx.attempt <= ctx.payload["fails"]:  # attempts that fail before one succeeds
        raise ValueError(f"attempt {ctx.attempt} fails")
    return ctx.attempt


@taskflow.handler("testing.staged")
def staged(ctx: taskflow.TaskContext) -> str:
    if ctx.stage == "":
        ctx.next_stage("index", context={"fetched": ctx.payload["doc"]})
    return f"indexed {ctx.context['fetched']}"


@taskflow.handler("testing.fan_out")
def fan_out(ctx: taskflow.TaskContext) -> int:
    for name in ctx.payload["names"]:
        taskflow.enqueue("testing.greet", {"name": name})
    return len(ctx.payload["names"])


@taskflow.handler("testing.sleepy")
def sleepy(ctx: taskflow.TaskContext) -> None:
    ctx.snooze(60, "not yet")


TYPES = ["testing.greet", "testing.flaky", "testing.staged", "testing.fan_out", "testing.sleepy"]


def statuses(*tasks: Task) -> list[str]:
    return [Task.objects.get(pk=t.pk).status for t in tasks]


# -- run_tasks ---------------------------------------------------------------------------------------


def test_run_tasks_runs_due_tasks_and_says_what_ran() -> None:
    task = taskflow.enqueue("testing.greet", {"name": "ada"})
    ran = run_tasks(TYPES)
    assert [(a.task_id, a.outcome, a.status, a.result) for a in ran] == [
        (task.id, "success", "success", {"greeting": "hello ada"})
    ]
    done = ran[0].task()
    assert (done.status, done.result, done.attempts) == ("success", {"greeting": "hello ada"}, 1)
    assert run_tasks(TYPES) == []


def test_every_handled_type_runs_by_default() -> None:
    task = taskflow.enqueue("testing.greet", {"name": "ada"})
    assert [a.task_id for a in run_tasks()] == [task.id]


def test_a_failed_attempt_is_retried_by_the_policy_after_its_delay() -> None:
    taskflow.enqueue("testing.flaky", {"fails": 2}, max_retries=3)
    ran = run_tasks(TYPES)
    assert [(a.attempt, a.outcome, a.status) for a in ran] == [(1, "error", "pending")]
    assert ran[0].error == "ValueError: attempt 1 fails" and "Traceback" in ran[0].traceback
    # The retry is due after its back-off: scheduled=True runs it as if the clock had moved on.
    ran = run_tasks(TYPES, scheduled=True)
    assert [(a.attempt, a.outcome, a.status) for a in ran] == [(2, "error", "pending"), (3, "success", "success")]


def test_retries_end_when_the_tasks_are_used_up() -> None:
    task = taskflow.enqueue("testing.flaky", {"fails": 5}, max_retries=1)
    ran = run_tasks(TYPES, scheduled=True)
    assert [(a.attempt, a.status) for a in ran] == [(1, "pending"), (2, "failed")]
    assert statuses(task) == ["failed"]


def test_stages_run_one_after_the_other_with_their_context() -> None:
    task = taskflow.enqueue("testing.staged", {"doc": "d1"})
    ran = run_tasks(TYPES)
    assert [(a.stage, a.outcome) for a in ran] == [("", "next_stage"), ("index", "success")]
    assert Task.objects.get(pk=task.pk).result == "indexed d1"


def test_dependents_run_once_their_dependencies_succeeded_and_not_after_a_failure() -> None:
    parent = taskflow.enqueue("testing.greet", {"name": "parent"})
    child = taskflow.enqueue("testing.greet", {"name": "child"}, depends_on=[parent])
    doomed = taskflow.enqueue("testing.flaky", {"fails": 1}, max_retries=0)
    orphan = taskflow.enqueue("testing.greet", {"name": "orphan"}, depends_on=[doomed])
    assert statuses(child, orphan) == ["waiting", "waiting"]
    ran = run_tasks(TYPES)
    assert [a.task_id for a in ran if a.outcome == "success"] == [parent.id, child.id]
    assert statuses(child, doomed, orphan) == ["success", "failed", "stopped"]


def test_tasks_a_handler_enqueues_run_too() -> None:
    taskflow.enqueue("testing.fan_out", {"names": ["a", "b"]})
    ran = run_tasks(TYPES)
    assert sorted(a.result["greeting"] for a in ran if a.task_type == "testing.greet") == ["hello a", "hello b"]


def test_delayed_tasks_wait_unless_scheduled() -> None:
    task = taskflow.enqueue("testing.greet", {"name": "later"}, run_after=3600)
    assert run_tasks(TYPES) == []
    assert [a.task_id for a in run_tasks(TYPES, scheduled=True)] == [task.id]


def test_a_paused_type_does_not_run() -> None:
    task = taskflow.enqueue("testing.greet", {"name": "paused"})
    ScheduleCfg.objects.filter(task_type="testing.greet").update(paused=True)
    assert run_tasks(TYPES) == []
    assert statuses(task) == ["pending"]


def test_a_concurrency_limit_holds_and_frees_its_slot_after_each_attempt() -> None:
    tasks = [taskflow.enqueue("testing.greet", {"name": str(n)}) for n in range(3)]
    ScheduleCfg.objects.filter(task_type="testing.greet").update(concurrency_limit=1)
    ran = run_tasks(TYPES)
    assert [a.task_id for a in ran] == [t.id for t in tasks]


def test_a_task_that_keeps_requeueing_itself_is_stopped_by_the_limit() -> None:
    taskflow.enqueue("testing.sleepy")
    assert [a.outcome for a in run_tasks(TYPES)] == ["snooze"]
    with pytest.raises(TooManyAttempts, match="testing.sleepy"):
        run_tasks(TYPES, scheduled=True, limit=5)


# -- eager ---------------------------------------------------------------------------------------------


def test_eager_runs_a_task_when_enqueued_outside_a_transaction() -> None:
    with eager():
        task = taskflow.enqueue("testing.greet", {"name": "now"})
        assert task.status == "pending"  # the object enqueue returned: read it again
        assert statuses(task) == ["success"]


def test_eager_waits_for_the_enqueuing_transaction_to_commit() -> None:
    with eager():
        with transaction.atomic():
            task = taskflow.enqueue("testing.greet", {"name": "in a transaction"})
            assert statuses(task) == ["pending"]
        assert statuses(task) == ["success"]
        with pytest.raises(RuntimeError), transaction.atomic():
            rolled_back = taskflow.enqueue("testing.greet", {"name": "rolled back"})
            raise RuntimeError("roll back")
    assert not Task.objects.filter(pk=rolled_back.pk).exists()


def test_eager_applies_the_engine_rules() -> None:
    with eager():
        staged_task = taskflow.enqueue("testing.staged", {"doc": "d2"})
        later = taskflow.enqueue("testing.greet", {"name": "later"}, run_after=3600)
        flaky_task = taskflow.enqueue("testing.flaky", {"fails": 1}, max_retries=2)
        parent = taskflow.enqueue("testing.greet", {"name": "parent"}, run_after=3600)
        child = taskflow.enqueue("testing.greet", {"name": "child"}, depends_on=[parent])
        assert statuses(staged_task, later, child) == ["success", "pending", "waiting"]
        assert Task.objects.get(pk=flaky_task.pk).attempts == 1  # retried after its back-off, not at once
        assert [a.task_id for a in run_tasks(TYPES, scheduled=True)] == [flaky_task.id, later.id, parent.id, child.id]
    assert statuses(flaky_task, child) == ["success", "success"]


def test_eager_only_for_the_types_named() -> None:
    with eager(["testing.staged"]):
        greet_task = taskflow.enqueue("testing.greet", {"name": "x"})
        staged_task = taskflow.enqueue("testing.staged", {"doc": "d3"})
    assert statuses(greet_task, staged_task) == ["pending", "success"]


def test_the_eager_fixture(taskflow_eager: None) -> None:
    task = taskflow.enqueue("testing.fan_out", {"names": ["x"]})
    assert statuses(task) == ["success"]
    assert_enqueued("testing.greet", payload={"name": "x"}, status=Status.SUCCESS)


@pytest.mark.django_db(transaction=True)
def test_eager_and_run_tasks_outside_a_test_transaction() -> None:
    with eager():
        task = taskflow.enqueue("testing.staged", {"doc": "d4"})
    assert statuses(task) == ["success"]
    parent = taskflow.enqueue("testing.greet", {"name": "parent"})
    child = taskflow.enqueue("testing.greet", {"name": "child"}, depends_on=[parent])
    assert [a.task_id for a in run_tasks(TYPES)] == [parent.id, child.id]


# -- what was enqueued -----------------------------------------------------------------------------------


def test_enqueued_matches_payloads_by_what_they_contain() -> None:
    one = taskflow.enqueue("testing.greet", {"name": "ada", "shop": {"id": 1, "tier": "gold"}})
    two = taskflow.enqueue("testing.greet", {"name": "bob", "shop": {"id": 2}}, key="bob")
    assert enqueued("testing.greet") == [one, two]
    assert enqueued("testing.greet", payload={"shop": {"id": 1}}) == [one]
    assert enqueued("testing.greet", payload={"shop": {"id": 1, "tier": "silver"}}) == []
    assert enqueued(key="bob") == [two]
    assert assert_enqueued("testing.greet", payload={"name": "bob"}) == [two]
    assert_enqueued("testing.greet", count=2)
    assert_not_enqueued("testing.greet", payload={"name": "carol"})


def test_a_failed_assertion_lists_what_was_enqueued() -> None:
    taskflow.enqueue("testing.greet", {"name": "ada"})
    listing = r"; found 0\. The testing.greet tasks: #\d+ \[pending\] payload=\{'name': 'ada'\}"
    expected = r"expected a testing.greet task\(s\) with payload containing \{'name': 'bob'\}"
    with pytest.raises(AssertionError, match=expected + listing):
        assert_enqueued("testing.greet", payload={"name": "bob"})
    with pytest.raises(AssertionError, match="expected 2 testing.greet"):
        assert_enqueued("testing.greet", count=2)
    with pytest.raises(AssertionError, match="expected no testing.greet"):
        assert_not_enqueued("testing.greet")
    with pytest.raises(AssertionError, match="No testing.other task at all"):
        assert_enqueued("testing.other")


def test_the_tasks_fixture(taskflow_tasks: Tasks) -> None:
    taskflow.enqueue("testing.greet", {"name": "fixture"})
    taskflow_tasks.assert_enqueued("testing.greet", status="pending")
    assert [a.outcome for a in taskflow_tasks.run(TYPES)] == ["success"]


def test_django_tasks_run_too() -> None:
    from django.tasks import TaskResultStatus

    from tests.taskapp import djtasks

    queued = djtasks.echo.enqueue(1, word="two")
    ran = run_tasks()
    assert [a.outcome for a in ran] == ["success"]
    queued.refresh()
    assert queued.status == TaskResultStatus.SUCCESSFUL
    assert queued.return_value == {"args": [1], "kwargs": {"word": "two"}}
    with eager():
        now = djtasks.echo.enqueue(3)
    now.refresh()
    assert now.status == TaskResultStatus.SUCCESSFUL
