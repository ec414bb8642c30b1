"""taskflow as a django.tasks backend, through Django's public API: Django's own backend-independent
tests (tests/tasks/ in Django) ported to TaskflowBackend, and the mapping of stored tasks to results.

Tasks here run in an in-process worker (a thread); tests/test_backend_processes.py runs a real
`manage.py taskworker`.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.tasks import (
    DEFAULT_TASK_QUEUE_NAME,
    TaskResultStatus,
    default_task_backend,
    task,
    task_backends,
)
from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, Task
from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.test import override_settings
from django.utils import timezone

import taskflow
from taskflow.backends import STATUSES, TaskflowBackend, TaskflowTask
from taskflow.engine import djangotasks
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.rescue import rescue_expired_attempts
from taskflow.models import ScheduleCfg, Status
from taskflow.models import Task as TaskRow
from taskflow.runtime.django_tasks import select_task_types
from tests.conftest import wait_until
from tests.taskapp import djtasks

pytestmark = pytest.mark.django_db


def in_event_loop(test):  # noqa: ANN001, ANN201
    """Run an async test in an event loop (Django's way: async_to_sync; its ORM calls come back here)."""

    @functools.wraps(test)
    def run() -> None:
        async_to_sync(test)()

    return run

ECHO = "tests.taskapp.djtasks.echo"


def row(result) -> TaskRow:  # noqa: ANN001
    return TaskRow.objects.get(pk=int(result.id))


def finished(result, timeout: float = 20.0):  # noqa: ANN001, ANN201
    """Wait until the task behind `result` is finished; its refreshed result."""

    def done() -> bool:
        result.refresh()
        return result.is_finished

    wait_until(done, timeout)
    return result


@pytest.fixture
def worker(start_worker):  # noqa: ANN001, ANN201
    """An in-process worker serving the test app's django tasks (both queues)."""
    return start_worker(select_task_types([], ["default", "other"]), concurrency=2)


# -- the backend and its tasks (Django's tests/tasks/test_tasks.py) -----------------------------------


def test_the_default_backend_is_taskflow_with_all_features() -> None:
    assert default_task_backend == task_backends["default"]
    assert isinstance(task_backends["default"], TaskflowBackend)
    assert default_task_backend.supports_defer and default_task_backend.supports_priority
    assert default_task_backend.supports_get_result and default_task_backend.supports_async_task
    assert isinstance(djtasks.noop_task, TaskflowTask) and isinstance(djtasks.noop_task_async, Task)


def test_enqueue_returns_a_ready_result_whose_id_is_the_task_id() -> None:
    result = djtasks.noop_task.enqueue(1, two=3)
    assert result.status == TaskResultStatus.READY and not result.is_finished
    assert result.task == djtasks.noop_task
    assert (result.args, result.kwargs) == ([1], {"two": 3})
    assert result.enqueued_at is not None and result.started_at is None and result.attempts == 0
    stored = row(result)
    assert (stored.task_type, stored.status) == ("tests.taskapp.djtasks.noop_task", Status.PENDING)
    assert stored.payload == {"args": [1], "kwargs": {"two": 3}}
    # The type is like any other: it has its ScheduleCfg row.
    assert ScheduleCfg.objects.filter(task_type="tests.taskapp.djtasks.noop_task").exists()


@in_event_loop
async def test_aenqueue_and_aget_result() -> None:
    for fn in (djtasks.noop_task, djtasks.noop_task_async):
        result = await fn.aenqueue()
        assert result.status == TaskResultStatus.READY
        assert (result.task, result.args, result.kwargs) == (fn, [], {})
        assert await fn.aget_result(result.id) == result


def test_enqueue_with_an_argument_that_is_not_json_writes_nothing() -> None:
    with pytest.raises(TypeError, match="Unsupported type"):
        djtasks.noop_task.enqueue(datetime.now())
    assert not TaskRow.objects.exists()


@in_event_loop
async def test_aenqueue_with_an_argument_that_is_not_json() -> None:
    with pytest.raises(TypeError, match="Unsupported type"):
        await djtasks.noop_task.aenqueue(datetime.now())


def test_a_whole_float_priority_and_arguments_too_large_to_store() -> None:
    assert row(djtasks.noop_task.using(priority=3.0).enqueue()).priority == 3
    with pytest.raises(InvalidTask, match="payload"):
        djtasks.noop_task.enqueue("x" * (2 * 1024 * 1024))  # over MAX_PAYLOAD_BYTES
    assert TaskRow.objects.count() == 1


def test_args_and_kwargs_round_trip_as_json() -> None:
    result = djtasks.echo.enqueue((1, 2), {"a": (3,)}, None, True, 1.5, "é", k={"nested": [1, {"x": None}]})
    again = djtasks.echo.get_result(result.id)
    assert again.args == [[1, 2], {"a": [3]}, None, True, 1.5, "é"]
    assert again.kwargs == {"k": {"nested": [1, {"x": None}]}}
    assert again == result


def test_using_priority_queue_name_and_run_after_make_new_tasks() -> None:
    now = timezone.now()
    assert djtasks.noop_task.using(priority=1).priority == 1 and djtasks.noop_task.priority == 0
    assert djtasks.noop_task.using(queue_name="other").queue_name == "other"
    assert djtasks.noop_task.queue_name == DEFAULT_TASK_QUEUE_NAME
    assert djtasks.noop_task.using(run_after=now).run_after == now and djtasks.noop_task.run_after is None
    same = djtasks.noop_task.using()
    assert same == djtasks.noop_task and same is not djtasks.noop_task
    chained = djtasks.noop_task.using(run_after=now).using(priority=10)
    assert (chained.priority, chained.run_after) == (10, now)


def test_using_an_unknown_backend() -> None:
    with pytest.raises(InvalidTaskBackend, match="The connection 'unknown' doesn't exist."):
        djtasks.noop_task.using(backend="unknown")


def test_invalid_priority_naive_run_after_and_unknown_queue_are_refused() -> None:
    message = f"priority must be a whole number between {TASK_MIN_PRIORITY} and {TASK_MAX_PRIORITY}."
    for priority in (-101, 101, 3.1):
        with pytest.raises(InvalidTask, match=message):
            djtasks.noop_task.using(priority=priority)
    for priority in (100, -100, 0):
        djtasks.noop_task.using(priority=priority)
    with pytest.raises(InvalidTask, match="run_after must be an aware datetime."):
        djtasks.noop_task.using(run_after=datetime.now())
    with pytest.raises(InvalidTask, match="Queue 'queue-2' is not valid for backend."):
        djtasks.noop_task.using(queue_name="queue-2")


def test_enqueue_validates_against_the_current_queues() -> None:
    in_other = djtasks.noop_task.using(queue_name="other")
    only_q1 = {"default": {"BACKEND": "taskflow.backends.TaskflowBackend", "QUEUES": ["q1"]}}
    with override_settings(TASKS=only_q1), pytest.raises(InvalidTask, match="Queue 'other' is not valid for backend"):
        in_other.enqueue()
    assert not TaskRow.objects.exists()


def test_an_empty_queues_list_allows_any_queue_a_task_type_can_hold() -> None:
    with override_settings(TASKS={"default": {"BACKEND": "taskflow.backends.TaskflowBackend", "QUEUES": []}}):
        result = djtasks.noop_task.using(queue_name="anything-goes").enqueue()
        assert row(result).task_type == "tests.taskapp.djtasks.noop_task:anything-goes"
        assert djtasks.noop_task.get_result(result.id).task.queue_name == "anything-goes"
        with pytest.raises(InvalidTask, match="cannot be a taskflow task type"):
            djtasks.noop_task.using(queue_name="has space")


def test_functions_must_be_module_level_and_take_context_first() -> None:
    with pytest.raises(InvalidTask, match="Task function must be defined at a module level."):
        task()(any)
    with pytest.raises(InvalidTask, match="Task takes context but does not have a first argument of 'context'."):
        task(takes_context=True)(djtasks.calculate_meaning_of_life.func)
    with pytest.raises(TypeError, match="run_after cannot be defined statically"):
        task(run_after=timezone.now())(djtasks.calculate_meaning_of_life.func)


def test_taskflow_options_are_checked_where_the_task_is_declared() -> None:
    fn = djtasks.calculate_meaning_of_life.func
    with pytest.raises(InvalidTask, match="max_retries must be an integer"):
        task(max_retries=-1)(fn)
    with pytest.raises(InvalidTask, match="timeout must be a positive number"):
        task(timeout=0)(fn)
    with pytest.raises(InvalidTask, match="key must be"):
        djtasks.noop_task.with_key("k" * 256)


def test_name_module_path_and_pickling() -> None:
    assert djtasks.noop_task.name == "noop_task"
    assert djtasks.noop_task.module_path == "tests.taskapp.djtasks.noop_task"
    assert pickle.loads(pickle.dumps(djtasks.noop_task)) == djtasks.noop_task
    keyed = djtasks.noop_task.with_key("k", 2)
    assert pickle.loads(pickle.dumps(keyed)) == keyed
    result = djtasks.noop_task.enqueue()
    assert pickle.loads(pickle.dumps(result)) == result


def test_call_runs_the_function_here() -> None:
    assert djtasks.calculate_meaning_of_life.call() == 42
    assert djtasks.noop_task_async.call() is None


# -- results ----------------------------------------------------------------------------------------


def test_get_result_equals_the_enqueued_result_and_refresh_keeps_it() -> None:
    result = djtasks.echo.using(priority=5, queue_name="other").enqueue(1)
    assert djtasks.echo.get_result(result.id) == result
    before = dataclasses.asdict(result)
    result.refresh()
    assert dataclasses.asdict(result) == before


@in_event_loop
async def test_arefresh() -> None:
    result = await djtasks.noop_task.aenqueue()
    before = dataclasses.asdict(result)
    await result.arefresh()
    assert dataclasses.asdict(result) == before


def test_get_result_of_a_missing_id() -> None:
    for missing in ("123", "not-a-number", ""):
        with pytest.raises(TaskResultDoesNotExist):
            djtasks.noop_task.get_result(missing)
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(djtasks.noop_task.aget_result)("123")


def test_get_result_of_a_task_that_is_not_a_django_task() -> None:
    plain = taskflow.enqueue("test.noop")
    with pytest.raises(TaskResultDoesNotExist, match="is not a django.tasks task"):
        default_task_backend.get_result(str(plain.id))


def test_a_result_of_another_function_is_a_mismatch() -> None:
    result = default_task_backend.enqueue(djtasks.noop_task_async, (), {})
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        djtasks.noop_task.get_result(result.id)
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        async_to_sync(djtasks.noop_task.aget_result)(result.id)


def test_the_stored_task_keeps_its_options() -> None:
    later = timezone.now() + timedelta(hours=1)
    fn = djtasks.failing_task_value_error.using(priority=-7, run_after=later).with_key("order-1", 3)
    result = fn.enqueue()
    stored = default_task_backend.get_result(result.id).task
    assert stored == fn
    assert (stored.max_retries, stored.key, stored.version, stored.run_after) == (2, "order-1", 3, later)
    assert (row(result).max_retries, row(result).key, row(result).priority) == (2, "order-1", -7)


def test_with_key_enqueues_once_per_identity() -> None:
    first = djtasks.echo.with_key("receipt-9").enqueue(1)
    again = djtasks.echo.with_key("receipt-9").enqueue(2)
    assert again.id == first.id and again.args == [1]
    newer = djtasks.echo.with_key("receipt-9", version=1).enqueue(3)
    assert newer.id != first.id
    assert row(first).status == Status.STOPPED  # superseded by the newer version


@pytest.mark.django_db(transaction=True)  # the release runs after the terminate commits
def test_after_makes_a_task_wait_for_others_and_follow_their_failure_or_run_anyway() -> None:
    first = djtasks.echo.enqueue(1)
    waits = djtasks.echo.after(first).enqueue(2)
    runs_anyway = djtasks.echo.after(first.id, on_failure="run").enqueue(3)
    assert waits.status == TaskResultStatus.READY and row(waits).status == Status.WAITING
    assert row(runs_anyway).status == Status.WAITING

    taskflow.terminate([int(first.id)], by="test", reason="not needed")
    waits.refresh()
    assert waits.status == TaskResultStatus.FAILED and first.id in row(waits).status_msg
    assert row(runs_anyway).status == Status.PENDING
    with pytest.raises(InvalidTask):
        djtasks.echo.after("12345").enqueue(4)  # no such task: nothing is written
    assert TaskRow.objects.count() == 3


def test_a_rolled_back_transaction_leaves_no_task_and_sends_no_signal(transactional_db) -> None:  # noqa: ANN001
    sent = []

    def receiver(sender, task_result, **kwargs):  # noqa: ANN001, ANN003, ANN202
        sent.append((sender, task_result.id))

    task_enqueued.connect(receiver)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            djtasks.noop_task.enqueue()
            assert TaskRow.objects.count() == 1  # visible inside the caller's transaction
            assert sent == []
            raise RuntimeError("roll back")
        assert not TaskRow.objects.exists() and sent == []
        with transaction.atomic():
            kept = djtasks.noop_task.enqueue()
            assert sent == []  # sent once it commits
        assert sent == [(TaskflowBackend, kept.id)]
    finally:
        task_enqueued.disconnect(receiver)


def test_status_mapping_covers_every_status_and_reads_an_unknown_one_as_ready() -> None:
    assert set(STATUSES) == set(Status.values)
    result = djtasks.noop_task.enqueue()
    TaskRow.objects.filter(pk=int(result.id)).update(status="archived")  # a status added by a later feature
    again = default_task_backend.get_result(result.id)
    assert again.status == TaskResultStatus.READY and not again.is_finished


def claim(task_type: str, worker_id: str = "host-a:1:w") -> list:
    return claim_batch(configs.get(task_type), 100, worker_id)


def test_attempts_map_to_worker_ids_errors_and_timestamps() -> None:
    result = djtasks.echo.enqueue()
    (first,) = claim(ECHO, "host-a:1:w")
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING and result.worker_ids == ["host-a:1:w"]
    assert result.started_at == result.last_attempted_at == first.claimed_at
    finish_attempts([Report(first, Outcome.ERROR, error="ValueError: x", detail="Trace\nValueError: x\n",
                            exception="builtins.ValueError")])
    TaskRow.objects.filter(pk=first.id).update(run_after=timezone.now())
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.finished_at is None  # waiting for its retry
    assert [(e.exception_class, e.traceback) for e in result.errors] == [(ValueError, "Trace\nValueError: x\n")]
    (second,) = claim(ECHO, "host-b:2:w")
    finish_attempts([Report(second, Outcome.SUCCESS, result={"ok": True})])
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == {"ok": True}
    assert result.worker_ids == ["host-a:1:w", "host-b:2:w"] and result.attempts == 2
    assert result.started_at == first.claimed_at and result.last_attempted_at == second.claimed_at
    assert result.finished_at >= result.last_attempted_at
    assert len(result.errors) == 1


def test_a_stopped_task_fails_with_who_stopped_it_and_why() -> None:
    pending = djtasks.echo.enqueue()
    running = djtasks.echo.using(queue_name="other").enqueue()
    claim(ECHO + ":other")
    taskflow.terminate([int(pending.id), int(running.id)], by="alice", reason="wrong batch")
    for result in (pending, running):
        result.refresh()
        assert result.status == TaskResultStatus.FAILED and result.is_finished
        error = result.errors[-1]
        assert error.exception_class is taskflow.exceptions.TaskStopped
        assert "stopped by alice: wrong batch" in error.traceback
        with pytest.raises(ValueError, match="Task failed"):
            _ = result.return_value


def test_a_success_kept_past_its_retention_stays_successful() -> None:
    result = djtasks.echo.enqueue(5)
    (attempt,) = claim(ECHO)
    finish_attempts([Report(attempt, Outcome.SUCCESS, result=5)])
    TaskRow.objects.filter(pk=attempt.id).update(status=Status.STOPPED, status_msg="success kept 1s, then stopped")
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5 and result.errors == []


def test_a_timed_out_attempt_names_taskflows_timeout_exception() -> None:
    result = djtasks.sleep_for.enqueue(10)
    claim("tests.taskapp.djtasks.sleep_for")
    TaskRow.objects.filter(pk=int(result.id)).update(lease_expires_at=timezone.now() - timedelta(seconds=5))
    assert rescue_expired_attempts() == 1
    result.refresh()
    assert result.status == TaskResultStatus.FAILED  # max_retries=0
    (error,) = result.errors
    assert error.exception_class is taskflow.exceptions.AttemptTimedOut
    assert "ran past its deadline" in error.traceback


def test_an_attempt_of_a_dead_worker_names_worker_lost(transactional_db) -> None:  # noqa: ANN001
    from taskflow.engine.rescue import rescue_dead_workers
    from taskflow.models import WorkerProcess

    result = djtasks.sleep_for.enqueue(10)
    claim("tests.taskapp.djtasks.sleep_for", "host-d:9:dead")
    beat = timezone.now() - timedelta(seconds=60)  # LIVENESS_TIMEOUT is 3 s in the test settings
    WorkerProcess.objects.create(worker_id="host-d:9:dead", host="host-d", pid=9, started_at=beat, heartbeat_at=beat)
    assert rescue_dead_workers() == 1
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.worker_ids == ["host-d:9:dead"]
    assert result.errors[0].exception_class is taskflow.exceptions.WorkerLost
    assert "stopped heartbeating" in result.errors[0].traceback


# -- task_finished, whoever ends the task ------------------------------------------------------------


@pytest.fixture
def finished_signals() -> Iterator[list[tuple]]:
    """The task_finished signals sent during the test: (sender, id, status, exception classes)."""
    seen: list[tuple] = []

    def receiver(sender, task_result, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append((sender, task_result.id, task_result.status, [e.exception_class for e in task_result.errors]))

    task_finished.connect(receiver)
    yield seen
    task_finished.disconnect(receiver)


SLEEP_FOR = "tests.taskapp.djtasks.sleep_for"  # max_retries=0: its first attempt is its last


def test_task_finished_is_sent_once_when_taskwatch_times_out_the_last_attempt(
    transactional_db, finished_signals  # noqa: ANN001
) -> None:
    result = djtasks.sleep_for.enqueue(10)
    (attempt,) = claim(SLEEP_FOR)
    TaskRow.objects.filter(pk=int(result.id)).update(lease_expires_at=timezone.now() - timedelta(seconds=5))
    assert rescue_expired_attempts() == 1
    assert finished_signals == [
        (TaskflowBackend, result.id, TaskResultStatus.FAILED, [taskflow.exceptions.AttemptTimedOut])
    ]
    assert finish_attempts([Report(attempt, Outcome.SUCCESS, result=1)]) == []  # the handler's late report
    assert len(finished_signals) == 1


def test_task_finished_is_sent_once_when_a_dead_workers_last_attempt_is_rescued(
    transactional_db, finished_signals  # noqa: ANN001
) -> None:
    from taskflow.engine.rescue import rescue_dead_workers
    from taskflow.models import WorkerProcess

    retried = djtasks.failing_task_value_error.enqueue()  # max_retries=2: rescued, it runs again
    result = djtasks.sleep_for.enqueue(10)
    claim(SLEEP_FOR, "host-d:9:dead")
    claim("tests.taskapp.djtasks.failing_task_value_error", "host-d:9:dead")
    beat = timezone.now() - timedelta(seconds=60)
    WorkerProcess.objects.create(worker_id="host-d:9:dead", host="host-d", pid=9, started_at=beat, heartbeat_at=beat)
    assert rescue_dead_workers() == 2
    assert row(retried).status == Status.PENDING
    assert finished_signals == [(TaskflowBackend, result.id, TaskResultStatus.FAILED, [taskflow.exceptions.WorkerLost])]
    assert rescue_dead_workers() == 0 and len(finished_signals) == 1


def test_task_finished_is_sent_once_when_an_operator_stops_a_task(transactional_db, finished_signals) -> None:  # noqa: ANN001
    from taskflow.engine import operations

    running = djtasks.sleep_for.enqueue(10)
    (attempt,) = claim(SLEEP_FOR)
    waiting = djtasks.echo.enqueue(1)
    other = taskflow.enqueue("test.noop", {})  # not a django.tasks task: no signal
    with transaction.atomic():
        assert operations.terminate([int(running.id), int(waiting.id), other.pk], by="alice").changed == 3
        assert finished_signals == []  # not before the commit
    stopped = [taskflow.exceptions.TaskStopped]
    assert sorted(finished_signals) == sorted(
        [
            (TaskflowBackend, running.id, TaskResultStatus.FAILED, stopped),
            (TaskflowBackend, waiting.id, TaskResultStatus.FAILED, stopped),
        ]
    )
    assert operations.terminate([int(running.id), int(waiting.id)], by="alice").changed == 0
    assert finish_attempts([Report(attempt, Outcome.SUCCESS, result=1)]) == []  # its handler returns: refused
    assert len(finished_signals) == 2


def test_task_finished_is_sent_when_a_task_waited_past_its_pending_timeout(
    transactional_db, finished_signals  # noqa: ANN001
) -> None:
    from taskflow.engine.expiry import fail_stale_pending

    result = djtasks.echo.enqueue(1)
    configs.get(ECHO)
    ScheduleCfg.objects.filter(pk=ECHO).update(pending_timeout=1)
    long_ago = timezone.now() - timedelta(hours=1)
    TaskRow.objects.filter(pk=int(result.id)).update(run_after=long_ago, order_time=long_ago, created_at=long_ago)
    assert fail_stale_pending() == 1
    assert [(s, i, status) for s, i, status, _ in finished_signals] == [
        (TaskflowBackend, result.id, TaskResultStatus.FAILED)
    ]
    assert fail_stale_pending() == 0 and len(finished_signals) == 1


def test_task_finished_is_sent_once_when_a_failed_dependency_stops_a_dependent(
    transactional_db, finished_signals  # noqa: ANN001
) -> None:
    first = djtasks.sleep_for.enqueue(10)  # max_retries=0
    dependent = djtasks.echo.after(first).enqueue(1)
    assert row(dependent).status == Status.WAITING
    (attempt,) = claim(SLEEP_FOR)
    finish_attempts([Report(attempt, Outcome.ERROR, error="boom")])
    assert row(dependent).status == Status.STOPPED
    assert sorted((i, status) for _, i, status, _ in finished_signals) == sorted(
        [(first.id, TaskResultStatus.FAILED), (dependent.id, TaskResultStatus.FAILED)]
    )


def test_task_finished_is_sent_once_when_a_newer_version_stops_an_older_one(
    transactional_db, finished_signals  # noqa: ANN001
) -> None:
    older = djtasks.echo.with_key("receipt-7", 1).enqueue(1)
    newer = djtasks.echo.with_key("receipt-7", 2).enqueue(2)
    assert (row(older).status, row(newer).status) == (Status.STOPPED, Status.PENDING)
    assert [(i, status) for _, i, status, _ in finished_signals] == [(older.id, TaskResultStatus.FAILED)]
    djtasks.echo.with_key("receipt-7", 3).enqueue(3)  # stops version 2 only
    assert [i for _, i, _, _ in finished_signals] == [older.id, newer.id]


def test_attempts_beyond_the_schedule_log_still_count() -> None:
    result = djtasks.echo.enqueue()
    TaskRow.objects.filter(pk=int(result.id)).update(attempts=9, status=Status.FAILED, status_msg="gave up")
    result.refresh()
    assert result.attempts == 9 and result.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in result.errors] == [taskflow.exceptions.TaskflowError]


# -- running (Django's tests/tasks/test_immediate_backend.py, with a worker) -------------------------


def test_a_task_runs_and_its_result_is_stored(worker) -> None:  # noqa: ANN001
    for fn in (djtasks.noop_task, djtasks.noop_task_async):
        result = finished(fn.enqueue(1, two=3))
        assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value is None
        assert result.started_at >= result.enqueued_at and result.finished_at >= result.started_at
        assert result.worker_ids == [worker.worker_id] and result.attempts == 1
        assert (result.args, result.kwargs) == ([1], {"two": 3})
    assert finished(djtasks.calculate_meaning_of_life.enqueue()).return_value == 42


@pytest.mark.parametrize(
    ("fn", "exception", "message"),
    [
        (djtasks.failing_task_system_exit, SystemExit, "This task failed due to SystemExit"),
        (djtasks.complex_exception, ValueError, "This task failed"),
    ],
)
def test_exceptions_fail_the_task_and_the_worker_goes_on(worker, fn, exception, message) -> None:  # noqa: ANN001
    result = finished(fn.enqueue())
    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    (error,) = result.errors
    assert error.exception_class is exception
    assert error.traceback.endswith(f"{exception.__name__}: {message}\n"), error.traceback
    # The worker is still running tasks.
    assert finished(djtasks.calculate_meaning_of_life.enqueue()).return_value == 42


def test_a_complex_exception_keeps_its_repr_in_the_traceback(worker) -> None:  # noqa: ANN001
    result = finished(djtasks.complex_exception.enqueue())
    assert 'ValueError(ValueError("This task failed"))' in result.errors[0].traceback


def test_a_return_value_that_is_not_json_fails_at_once(worker) -> None:  # noqa: ANN001
    result = finished(djtasks.complex_return_value.enqueue())  # max_retries=3, yet one attempt
    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    (error,) = result.errors
    assert issubclass(error.exception_class, TypeError) and error.exception_class is taskflow.exceptions.InvalidResult
    assert "Unsupported type" in error.traceback and "is not JSON" in error.traceback


def test_the_runner_re_raises_keyboard_interrupt_without_task_finished(caplog) -> None:  # noqa: ANN001
    from taskflow.runtime.context import TaskContext
    from taskflow.runtime.django_tasks import run_django_task

    djtasks.failing_task_keyboard_interrupt.enqueue()
    (attempt,) = claim("tests.taskapp.djtasks.failing_task_keyboard_interrupt")
    with caplog.at_level("DEBUG", logger="django.tasks"), pytest.raises(KeyboardInterrupt):
        run_django_task(TaskContext(attempt))
    assert [r.getMessage().split()[-1] for r in caplog.records if r.name == "django.tasks"] == ["state=RUNNING"]


def test_keyboard_interrupt_is_re_raised_and_stops_the_worker(start_worker, caplog) -> None:  # noqa: ANN001
    worker = start_worker(select_task_types(["tests.taskapp.djtasks.failing_task_keyboard_interrupt"], []))
    with caplog.at_level("DEBUG", logger="django.tasks"):
        result = finished(djtasks.failing_task_keyboard_interrupt.enqueue())
    assert worker._stopping.is_set()  # the worker stops, as after Ctrl-C
    assert result.errors[0].exception_class is KeyboardInterrupt
    # The task ended failed, and that is announced once like any other end (Django's logger: ERROR).
    wait_until(lambda: len([r for r in caplog.records if r.name == "django.tasks"]) == 3)
    assert [r.levelname for r in caplog.records if r.name == "django.tasks"] == ["DEBUG", "INFO", "ERROR"]


def test_context_gives_the_result_and_counts_attempts_from_one(worker) -> None:  # noqa: ANN001
    result = finished(djtasks.get_task_id.enqueue())
    assert result.return_value == result.id
    assert finished(djtasks.test_context.enqueue(1)).status == TaskResultStatus.SUCCESSFUL
    flaky = finished(djtasks.flaky_with_context.enqueue(3))
    assert flaky.status == TaskResultStatus.SUCCESSFUL and flaky.attempts == 3
    assert flaky.return_value == {"attempt": 3, "worker_ids": [worker.worker_id] * 3}
    assert [e.exception_class for e in flaky.errors] == [RuntimeError, RuntimeError]


def test_signals_and_django_logging(worker, caplog) -> None:  # noqa: ANN001
    seen = []

    def receiver(sender, task_result, signal, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append((signal, sender, task_result.id, task_result.status, task_result.attempts))

    signals = {task_enqueued: "enqueued", task_started: "started", task_finished: "finished"}
    for signal in signals:
        signal.connect(receiver)
    try:
        with caplog.at_level("DEBUG", logger="django.tasks"):
            # task_finished goes out once the end commits: wait for it before the next enqueue.
            ok = finished(djtasks.flaky_with_context.enqueue(2))
            wait_until(lambda: seen and seen[-1][0] is task_finished)
            bad = finished(djtasks.failing_task_value_error.enqueue())  # max_retries=2: three attempts
            wait_until(lambda: seen[-1][0] is task_finished)
    finally:
        for signal in signals:
            signal.disconnect(receiver)
    events = [(signals[s], sender, i, status, n) for s, sender, i, status, n in seen]
    R, F, S = TaskResultStatus.RUNNING, TaskResultStatus.FAILED, TaskResultStatus.SUCCESSFUL  # noqa: N806
    assert events == [
        ("enqueued", TaskflowBackend, ok.id, TaskResultStatus.READY, 0),
        ("started", TaskflowBackend, ok.id, R, 1),
        ("started", TaskflowBackend, ok.id, R, 2),
        ("finished", TaskflowBackend, ok.id, S, 2),
        ("enqueued", TaskflowBackend, bad.id, TaskResultStatus.READY, 0),
        ("started", TaskflowBackend, bad.id, R, 1),
        ("started", TaskflowBackend, bad.id, R, 2),
        ("started", TaskflowBackend, bad.id, R, 3),
        ("finished", TaskflowBackend, bad.id, F, 3),
    ]
    logged = [r for r in caplog.records if r.name == "django.tasks" and bad.id in r.getMessage()]
    assert "state=FAILED" in logged[-1].getMessage() and logged[-1].levelname == "ERROR"
    # Sent after the commit, not inside the handler's except block: the traceback is in the result.
    assert bad.errors[-1].exception_class is ValueError and "ValueError" in bad.errors[-1].traceback


def test_queues_select_task_types() -> None:
    types = select_task_types(["tests.taskapp.djtasks.echo"], ["other"])
    assert types == ["tests.taskapp.djtasks.echo:other"]
    assert select_task_types(["test.noop", ECHO + ":other"], []) == ["test.noop", ECHO + ":other"]
    every = select_task_types([], [])
    assert "test.noop" in every and ECHO in every and ECHO + ":other" in every
    only_queues = select_task_types([], ["default"])
    assert ECHO in only_queues and "test.noop" not in only_queues
    assert djtasks.noop_task.module_path in djtasks_known()
    with override_settings(TASKS={"default": {"BACKEND": "taskflow.backends.TaskflowBackend", "QUEUES": []}}):
        djtasks.echo.using(queue_name="seen-before").enqueue()
        assert select_task_types([ECHO], []) == [ECHO, ECHO + ":seen-before"]


def djtasks_known() -> list[str]:
    return djangotasks.known_module_paths()


# -- the example project ----------------------------------------------------------------------------


def test_the_example_view_enqueues_a_django_task_and_shows_its_result(client, start_worker) -> None:  # noqa: ANN001
    from demo.tasks import count_words

    assert client.get("/words/").status_code == 200
    response = client.post("/words/", {"text": "taskflow runs plain Django tasks"})
    assert response.status_code == 302
    result_id = response["Location"].rstrip("/").rsplit("/", 1)[1]
    assert row(count_words.get_result(result_id)).task_type == "demo.tasks.count_words"
    waiting = client.get(response["Location"])
    assert waiting.status_code == 200 and b'http-equiv="refresh"' in waiting.content
    assert b"READY" in waiting.content

    start_worker(select_task_types(["demo.tasks.count_words"], []))
    finished(count_words.get_result(result_id))
    page = client.get(response["Location"]).content.decode()
    assert "SUCCESSFUL" in page and 'data-field="words">5<' in page and ">plain<" not in page
    assert 'data-field="longest">taskflow<' in page and "refresh" not in page


def test_the_example_result_page_of_an_unknown_or_foreign_id_is_404(client) -> None:  # noqa: ANN001
    assert client.get("/words/123/").status_code == 404
    assert client.get("/words/nope/").status_code == 404
    other = djtasks.noop_task.enqueue()
    assert client.get(f"/words/{other.id}/").status_code == 404
