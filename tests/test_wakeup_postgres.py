"""Wake-ups without Redis on PostgreSQL: NOTIFY sent with the work's transaction, LISTEN in the worker."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from django.db import connection, transaction

import taskflow
from taskflow.engine import wakeup
from taskflow.models import Status, Task, WorkerProcess

from .conftest import read_runs, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql" or bool(wakeup.get_settings().REDIS_ALIAS),
        reason="wake-ups travel through the database on PostgreSQL without Redis",
    ),
]


class Heard:
    """What a listener was told: wake-ups (sets of types) and stop notices."""

    def __init__(self) -> None:
        self.wakeups: list[set[str]] = []
        self.stops: list[dict[int, int]] = []

    def types(self) -> set[str]:
        return set().union(*self.wakeups)


@pytest.fixture
def listening():  # noqa: ANN201
    """A listener thread in this process (as a worker starts it); stopped at teardown."""
    stop = threading.Event()
    heard = Heard()
    thread = wakeup.start_listener(heard.wakeups.append, stop, heard.stops.append)
    assert thread is not None
    assert wait_until(lambda: heard.wakeups, timeout=10)  # connected: it looks once at the start
    yield heard
    stop.set()
    thread.join(10)


def listener_sessions() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s",
            [f"LISTEN {wakeup.PG_STOP}%"],
        )
        return [row[0] for row in cursor.fetchall()]


def test_an_enqueue_is_heard_once_committed_and_a_rolled_back_one_never(listening: Heard) -> None:
    with transaction.atomic():
        taskflow.enqueue("test.noop", {})
        taskflow.enqueue_many([{"task_type": "test.record"}, {"task_type": "test.record"}])
        time.sleep(0.3)
        assert listening.types() == set()  # not before the commit
    assert wait_until(lambda: {"test.noop", "test.record"} <= listening.types(), timeout=10)

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        taskflow.enqueue("test.fail", {})
        raise Undo
    taskflow.enqueue("test.sleep", {}, key="k")  # keyed, autocommit: its own transaction
    assert wait_until(lambda: "test.sleep" in listening.types(), timeout=10)
    assert "test.fail" not in listening.types()


def test_a_task_due_later_wakes_no_one(listening: Heard) -> None:
    taskflow.enqueue("test.sleep", {}, run_after=60)
    taskflow.enqueue("test.noop", {})
    assert wait_until(lambda: "test.noop" in listening.types(), timeout=10)
    assert "test.sleep" not in listening.types()


def test_stop_notices_are_heard() -> None:
    stop = threading.Event()
    heard = Heard()
    thread = wakeup.start_listener(lambda types: None, stop, heard.stops.append)
    try:
        assert wait_until(listener_sessions, timeout=10)
        many = {task_id: 7 for task_id in range(10**15, 10**15 + 1000)}  # more than one notice holds
        wakeup.publish_stops(many)
        assert wait_until(lambda: sum(len(s) for s in heard.stops) == 1000, timeout=10)
        assert {k: v for s in heard.stops for k, v in s.items()} == many
    finally:
        stop.set()
        thread.join(10)


def test_the_listener_connects_again_after_its_session_is_killed(listening: Heard) -> None:
    (pid,) = listener_sessions()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    # A new session, which looks once at the start (what it may have missed), then hears again.
    assert wait_until(lambda: listener_sessions() and listener_sessions() != [pid], timeout=20)
    # The session is listed once it has run its LISTENs; on a loaded machine its thread may still be
    # on its way into the wait, so the work is enqueued again until one notice is heard (each is new).
    def heard_new_work() -> bool:
        taskflow.enqueue("test.noop", {})
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if "test.noop" in listening.types():
                return True
            time.sleep(0.05)
        return False

    assert wait_until(heard_new_work, timeout=20)


@pytest.mark.processes
def test_a_worker_is_woken_long_before_its_poll_interval(spawn, process_env: dict, run_log: Path) -> None:
    # Workers poll every 60 s here and beat every 20 s: only the database's notices can be this quick.
    overrides = {"SCHEDULE_INTERVAL": 60.0, "HEARTBEAT_INTERVAL": 20.0, "LIVENESS_TIMEOUT": 60.0}
    env = {"TASKFLOW_TEST_OVERRIDES": json.dumps(overrides)}
    proc = spawn("taskworker", "--types", "test.record,test.until_stopped", "--concurrency", "2", env=env)
    assert wait_until(lambda: WorkerProcess.objects.exists(), timeout=60)
    assert wait_until(listener_sessions, timeout=30)
    time.sleep(2)  # past the first polls of a starting worker (within its first second)

    task = taskflow.enqueue("test.record", {})
    assert wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.SUCCESS, timeout=20)

    # The session dies (a database restart, say): the worker listens again and is still woken.
    (pid,) = listener_sessions()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert wait_until(lambda: listener_sessions() and listener_sessions() != [pid], timeout=30)
    time.sleep(1)
    again = taskflow.enqueue("test.record", {})
    assert wait_until(lambda: Task.objects.get(pk=again.pk).status == Status.SUCCESS, timeout=20)

    # An operator's stop reaches the running handler the same way (its next beat is 20 s away).
    running = taskflow.enqueue("test.until_stopped", {"seconds": 40})
    assert wait_until(lambda: any(r[2] == "start" and r[0] == str(running.pk) for r in read_runs(run_log)), 20)
    taskflow.terminate([running.pk], by="test")
    assert wait_until(lambda: any(r[2] == "noticed" and r[0] == str(running.pk) for r in read_runs(run_log)), 15)
    assert proc.poll() is None
