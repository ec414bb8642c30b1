"""The worker under faults: bad handlers fail only their own task, no thread dies silently, a
worker that cannot go on stops, connections come back, and workers do not poll in step."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from django.db import OperationalError, connection

import taskflow
from taskflow.engine import configs as configs_module
from taskflow.engine import wakeup, workers
from taskflow.models import ScheduleCfg, Status, Task, WorkerProcess
from taskflow.runtime import connections, supervision
from taskflow.runtime import worker as worker_module
from taskflow.runtime.worker import Worker, WorkerFailed

from .conftest import run_in_thread, wait_until

FINAL = [Status.SUCCESS, Status.FAILED]


def final_rows(tasks: list[Task], timeout: float = 30.0) -> dict[int, Task]:
    ids = [t.pk for t in tasks]
    wait_until(lambda: Task.objects.filter(pk__in=ids, status__in=FINAL).count() == len(ids), timeout=timeout)
    return Task.objects.in_bulk(ids)


def set_cfg(task_type: str, **fields: Any) -> None:
    ScheduleCfg.objects.update_or_create(task_type=task_type, defaults=fields)
    configs_module.configs.clear()


# -- one bad handler fails only its own task --------------------------------------------------------

MISBEHAVIOURS = {
    "priority": "InvalidTask: NextStage priority must be an integer from -100 to 100; got 500",
    "fail_with_number": "InvalidTask: PermanentFailure reason must be a string of at most 4000 characters; got 404",
    "snooze_forever": "InvalidTask: Snooze delay must be a number of seconds from 0 to 31536000 (a year); got inf",
    "context_not_json": "InvalidTask: NextStage context must be JSON-serialisable",
    "result_not_json": "InvalidTask: result must be JSON-serialisable",
    "bad_enqueue": "InvalidTask: priority must be an integer from -100 to 100; got 1000",
    "refused_by_database": "the database refused this attempt's report: IntegrityError",
}


def test_malformed_signals_and_results_fail_only_their_own_task_at_once(start_worker) -> None:
    bad = {a: taskflow.enqueue("test.misbehave", {"action": a}, max_retries=3) for a in MISBEHAVIOURS}
    good = taskflow.enqueue_many([{"task_type": "test.record", "payload": {"n": i}} for i in range(20)])
    worker = start_worker(["test.misbehave", "test.record"], concurrency=4)

    rows = final_rows([*bad.values(), *good])

    for action, message in MISBEHAVIOURS.items():
        row = rows[bad[action].pk]
        assert (row.status, row.attempts) == (Status.FAILED, 1), (action, row.status_msg)
        assert row.status_msg.startswith(message), row.status_msg
    assert all(rows[t.pk].status == Status.SUCCESS for t in good)
    # The worker is still working.
    later = taskflow.enqueue("test.record", {"n": "later"})
    assert final_rows([later])[later.pk].status == Status.SUCCESS
    assert worker.in_flight == 0


def test_a_handler_that_raises_system_exit_does_not_end_its_thread(start_worker) -> None:
    exits = taskflow.enqueue("test.misbehave", {"action": "exit"}, max_retries=0)
    start_worker(["test.misbehave"], concurrency=1)
    assert final_rows([exits])[exits.pk].status_msg.startswith("failed after 1 attempts: SystemExit: 3")
    after = taskflow.enqueue("test.misbehave", {})  # needs the same, only, handler thread
    assert final_rows([after])[after.pk].status == Status.SUCCESS


# -- no thread dies silently -------------------------------------------------------------------------


def fail_once(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, error: BaseException, *, on_call: int = 1
) -> list[int]:
    """Make `owner.name` raise `error` on its `on_call`-th call only."""
    real, calls = getattr(owner, name), []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == on_call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)
    return calls


@pytest.mark.parametrize(
    ("owner", "name", "loop"),
    [
        (worker_module, "finish_attempts", "taskflow-reporter"),
        (worker_module, "claim_batch", "taskflow-claim-loop"),
        (workers, "beat", "taskflow-liveness"),
    ],
)
def test_an_unexpected_error_is_logged_with_its_traceback_and_the_loop_goes_on(
    start_worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    owner,
    name,
    loop,  # noqa: ANN001
) -> None:
    monkeypatch.setattr(supervision, "FIRST_PAUSE", 0.05)
    calls = fail_once(monkeypatch, owner, name, RuntimeError("a bug"))
    task = taskflow.enqueue("test.record", {"n": 1})
    with caplog.at_level(logging.ERROR, logger="taskflow"):
        worker = start_worker(["test.record"], concurrency=2)
        assert final_rows([task])[task.pk].status == Status.SUCCESS
        wait_until(lambda: len(calls) >= 2)

    [failure] = [r for r in caplog.records if r.getMessage().startswith(f"{loop} failed unexpectedly")]
    assert failure.exc_info and "RuntimeError: a bug" in caplog.text
    assert worker._failure is None and not worker._stopping.is_set()


@pytest.mark.parametrize(
    ("owner", "name", "loop"),
    [
        (worker_module, "finish_attempts", "taskflow-reporter"),
        (worker_module, "claim_batch", "taskflow-claim-loop"),
        (workers, "beat", "taskflow-liveness"),
        (wakeup.RedisListener, "listen", "taskflow-wakeup"),
    ],
)
def test_a_thread_that_dies_stops_the_worker_for_a_restart(
    transactional_db,
    monkeypatch: pytest.MonkeyPatch,
    owner,
    name,
    loop,  # noqa: ANN001
) -> None:
    if loop == "taskflow-wakeup" and worker_module.Limiter().uses_redis is False:
        pytest.skip("the wake-up listener runs only with Redis")
    # The liveness thread dies after its first beat, which registered the worker.
    calls = fail_once(monkeypatch, owner, name, SystemExit(9), on_call=2 if name == "beat" else 1)
    taskflow.enqueue("test.record", {"n": 1})  # something to claim and report
    worker = Worker(["test.record"], concurrency=2)
    thread, raised = run_in_thread(worker)

    thread.join(timeout=30)
    assert not thread.is_alive(), f"the worker kept running after its {loop} thread died"
    assert calls
    assert [type(e) for e in raised] == [WorkerFailed]
    assert str(raised[0]) == f"{loop} died: SystemExit: 9"
    # It stopped beating and kept its row, so it looks dead and taskwatch rescues what it held.
    assert WorkerProcess.objects.filter(worker_id=worker.worker_id).exists()


def test_a_worker_whose_liveness_keeps_failing_stops_running_tasks_at_once(
    transactional_db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It would look dead: its tasks would be rescued and run twice, so it must not run them on."""
    monkeypatch.setattr(supervision, "FIRST_PAUSE", 0.05)
    beats = []

    def broken_beat(*args: Any, **kwargs: Any) -> None:
        beats.append(1)
        if len(beats) > 1:
            raise RuntimeError("a bug")

    monkeypatch.setattr(workers, "beat", broken_beat)
    task = taskflow.enqueue("test.sleep", {"seconds": 60})
    worker = Worker(["test.sleep"], concurrency=1, grace=60)
    thread, raised = run_in_thread(worker)

    thread.join(timeout=30)  # far less than the task or the grace period
    assert not thread.is_alive()
    assert str(raised[0]).startswith("taskflow-liveness failed 5 times in a row: RuntimeError: a bug")
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.attempts) == (Status.PENDING, 1)
    assert "interrupted" in row.status_msg


# -- connections come back ---------------------------------------------------------------------------


def kill_backend(backend: int) -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"KILL {int(backend)}")
        else:
            cursor.execute("SELECT pg_terminate_backend(%s)", [backend])


@pytest.fixture
def server_database(transactional_db) -> None:  # noqa: ANN001
    if connection.vendor == "sqlite":
        pytest.skip("SQLite connections are files: no server closes them")


def test_a_handler_thread_replaces_a_connection_the_server_closed_while_it_was_idle(
    server_database, start_worker
) -> None:
    first = taskflow.enqueue("test.uses_db", max_retries=0)
    start_worker(["test.uses_db"], concurrency=1)
    backend = final_rows([first])[first.pk].result["backend"]
    kill_backend(backend)  # what a restart, a fail-over or wait_timeout does to an idle connection
    time.sleep(connections.IDLE_CHECK + 0.5)

    second = taskflow.enqueue("test.uses_db", max_retries=0)
    row = final_rows([second])[second.pk]

    assert row.status == Status.SUCCESS, row.status_msg
    assert row.result["backend"] != backend


def test_after_a_database_error_a_handler_thread_reconnects_before_its_next_task(server_database, start_worker) -> None:
    first = taskflow.enqueue("test.uses_db", max_retries=0)
    start_worker(["test.uses_db"], concurrency=1)
    backend = final_rows([first])[first.pk].result["backend"]
    kill_backend(backend)

    # Retries come 0.1 s apart: an attempt may fail on the dead connection, but not every one.
    tasks = [taskflow.enqueue("test.uses_db", max_retries=3) for _ in range(3)]
    rows = final_rows(tasks)
    assert [r.status for r in rows.values()] == [Status.SUCCESS] * 3, [r.status_msg for r in rows.values()]


# -- workers do not poll in step ---------------------------------------------------------------------


def test_workers_started_together_first_poll_at_different_moments(transactional_db) -> None:
    def first_polls(interval: float) -> list[float]:
        set_cfg("test.record", schedule_interval=interval)
        offsets = []
        for _ in range(40):
            worker = Worker(["test.record"], concurrency=1)
            before = time.monotonic()
            worker.connector._claim_round(1, 1, False)
            offsets.append(worker.connector._next_poll["test.record"] - before)
        return offsets

    spread = first_polls(0.8)
    assert all(-0.05 <= o <= 0.85 for o in spread)
    assert max(spread) - min(spread) > 0.3  # spread over the interval, not bunched at its start or end
    # A long interval: the first look still comes within a second, so a restart never leaves due work waiting.
    assert all(o <= 1.05 for o in first_polls(600.0))


def test_a_burst_worker_claims_at_once(transactional_db) -> None:
    set_cfg("test.record", schedule_interval=60.0)
    tasks = taskflow.enqueue_many([{"task_type": "test.record", "payload": {"n": i}} for i in range(3)])
    thread, raised = run_in_thread(Worker(["test.record"], concurrency=2, burst=True))
    thread.join(timeout=30)
    assert not thread.is_alive() and not raised
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS).count() == 3


def test_a_woken_worker_claims_at_once(start_worker) -> None:
    set_cfg("test.record", schedule_interval=60.0)
    worker = start_worker(["test.record"], concurrency=1)
    wait_until(lambda: "test.record" in worker.connector._next_poll)  # its first round is done: the next poll is far
    task = taskflow.enqueue("test.record", {"n": 1})  # wakes it (in this process, and through Redis)
    assert final_rows([task], timeout=20)[task.pk].status == Status.SUCCESS


def test_tasks_of_a_claim_whose_answer_was_lost_run_at_once_not_after_their_deadline(
    start_worker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim commits and its connection dies before the answer arrives (a database restart, say).

    The worker still beats, so only its own hand-back (DatabaseConnector.between_claims) brings the
    tasks back before their deadline, here five minutes away; their lost attempt is not counted.
    """
    monkeypatch.setattr(supervision, "FIRST_PAUSE", 0.05)
    real, answers = worker_module.claim_batch, []

    def answer_lost(*args: Any, **kwargs: Any) -> Any:
        claimed = real(*args, **kwargs)
        answers.append(len(claimed))
        if claimed and answers.count(0) + 1 == len(answers):  # the first claim that got anything
            raise OperationalError(2013, "Lost connection to server during query")
        return claimed

    monkeypatch.setattr(worker_module, "claim_batch", answer_lost)
    set_cfg("test.record", max_processing_time=300)
    tasks = taskflow.enqueue_many([{"task_type": "test.record", "payload": {"n": i}} for i in range(40)])
    with caplog.at_level(logging.WARNING, logger="taskflow"):
        start_worker(["test.record"], concurrency=4)
        rows = final_rows(tasks, timeout=30)

    lost = next(n for n in answers if n)
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("handed back")]
    assert told == [f"handed back {lost} task(s) claimed for this worker by a claim whose answer was lost"]
    assert lost >= 4  # started and claimed-ahead attempts were both in it
    assert {(r.status, r.attempts) for r in rows.values()} == {(Status.SUCCESS, 1)}
    assert Task.objects.filter(status_msg__startswith="handed back").count() == 0


def test_while_the_database_is_down_the_hand_back_is_tried_once_a_second_not_at_every_call(
    transactional_db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown calls between_claims every 50 ms: an unreachable database must not be asked (and logged) each time."""
    tries: list[float] = []

    def unreachable(*args: Any, **kwargs: Any) -> int:
        tries.append(time.monotonic())
        raise OperationalError(2003, "Can't connect to MySQL server")

    monkeypatch.setattr(worker_module, "hand_back_unheld", unreachable)
    connector = Worker(["test.record"], concurrency=1).connector
    connector._claim_unanswered = True
    for _ in range(5):
        connector.between_claims([])
    assert len(tries) == 1
    connector._next_hand_back = 0.0  # a second later
    monkeypatch.setattr(worker_module, "hand_back_unheld", lambda *args, **kwargs: 0)
    connector.between_claims([])
    assert connector._claim_unanswered is False
