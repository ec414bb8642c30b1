"""finish_attempts under faults: a refused report fails only its task, statements stay bounded,
an outage keeps the reports for later, and a repeated report counts once."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from django.db import DatabaseError, OperationalError, connection, transaction
from django.utils import timezone

import taskflow
from taskflow.engine import finishing, sql
from taskflow.engine.attempts import ClaimedTask, Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.limiter import Limiter, held_slots
from taskflow.exceptions import NextStage, PermanentFailure
from taskflow.models import ScheduleCfg, Status, Task

T = "test.noop"


def claim(count: int, task_type: str = T) -> list[ClaimedTask]:
    taskflow.enqueue_many([{"task_type": task_type, "payload": {"i": i}} for i in range(count)])
    return claim_batch(configs.get(task_type), count, "host-a:1:abc")


def refused_by_the_database(task: ClaimedTask) -> Report:
    """A report that passes every check before the database, whose CHECK constraint refuses it."""
    step = NextStage("next")
    step.priority = 500  # past the signal's own check, as a buggy caller might
    return Report(task, Outcome.NEXT_STAGE, next_stage=step)


def rows(tasks: list[ClaimedTask]) -> list[dict[str, Any]]:
    by_id = {r["id"]: r for r in Task.objects.filter(pk__in=[t.id for t in tasks]).values()}
    return [by_id[t.id] for t in tasks]


def refused_then_successes(tasks: list[ClaimedTask], refused_at: int) -> list[Report]:
    return [
        refused_by_the_database(t) if i == refused_at else Report(t, Outcome.SUCCESS, result={"n": i})
        for i, t in enumerate(tasks)
    ]


def check_only_the_refused_task_failed(tasks: list[ClaimedTask], refused_at: int, accepted: list[Report]) -> None:
    assert sorted(r.task.id for r in accepted) == sorted(t.id for t in tasks)
    for i, row in enumerate(rows(tasks)):
        if i == refused_at:
            assert (row["status"], row["stage"], row["priority"], row["result"]) == (Status.FAILED, "", 0, None)
            assert row["status_msg"].startswith("the database refused this attempt's report: IntegrityError")
            assert "priority" in row["status_msg"]  # the constraint's name, in the database's own words
            assert row["lease_expires_at"] is None and row["finished_at"] is not None
        else:
            assert (row["status"], row["result"]) == (Status.SUCCESS, {"n": i})


@pytest.mark.django_db(transaction=True)
def test_a_report_the_database_refuses_fails_only_its_own_task() -> None:
    tasks = claim(9)
    accepted = finish_attempts(refused_then_successes(tasks, refused_at=6))
    check_only_the_refused_task_failed(tasks, 6, accepted)
    refused = next(r for r in accepted if r.task.id == tasks[6].id)
    assert refused.written["status"] == Status.FAILED  # what was written, not what was asked


@pytest.mark.django_db
def test_a_refused_report_inside_the_callers_transaction_leaves_it_usable() -> None:
    # pytest-django's `db` wraps the test in a transaction, as an operator action's view might.
    tasks = claim(4)
    accepted = finish_attempts(refused_then_successes(tasks, refused_at=0))
    check_only_the_refused_task_failed(tasks, 0, accepted)
    assert Task.objects.count() == 4  # the transaction still works


@pytest.mark.django_db(transaction=True)
def test_a_report_the_state_machine_cannot_use_fails_only_its_own_task() -> None:
    tasks = claim(3)
    signal = PermanentFailure("gone")
    signal.reason = 404  # type: ignore[assignment]  # past the signal's own check
    reports = [Report(tasks[0], Outcome.SUCCESS, result=1), Report(tasks[1], Outcome.FAIL, error=signal.reason)]
    reports.append(Report(tasks[2], Outcome.SUCCESS, result={"ids": {1, 2}}))  # not JSON: the driver cannot send it

    assert len(finish_attempts(reports)) == 3

    first, second, third = rows(tasks)
    assert (first["status"], first["result"]) == (Status.SUCCESS, 1)
    assert second["status"] == Status.FAILED
    assert second["status_msg"].startswith("its end could not be recorded: TypeError")
    assert third["status"] == Status.FAILED and third["result"] is None
    assert third["status_msg"].startswith("could not write this attempt's report: TypeError")


@pytest.mark.django_db(transaction=True)
def test_an_outage_is_not_a_refusal_the_reports_wait_for_the_database(monkeypatch: pytest.MonkeyPatch) -> None:
    tasks = claim(4)
    reports = refused_then_successes(tasks, refused_at=1)
    monkeypatch.setattr(finishing, "_database_answers", lambda: False)  # the server went away meanwhile

    with pytest.raises(Exception):  # noqa: B017 - whatever the failed statement raised
        finish_attempts(reports)

    assert [r["status"] for r in rows(tasks)] == [Status.PROCESSING] * 4  # nothing failed, nothing dropped
    assert all(r.written is None for r in reports)
    monkeypatch.undo()  # the database is back: the same reports are finished now
    check_only_the_refused_task_failed(tasks, 1, finish_attempts(reports))


@pytest.mark.django_db(transaction=True)
def test_what_was_written_before_an_outage_is_marked_and_keeps_its_slots(
    monkeypatch: pytest.MonkeyPatch, redis_client
) -> None:
    ScheduleCfg.objects.update_or_create(task_type=T, defaults={"concurrency_limit": 50})
    configs.clear()
    limiter = Limiter()
    grant = limiter.take(T, 8, 50)
    tasks = claim(8)
    limiter.confirm(grant, tasks)
    assert held_slots(T) == 8
    reports = refused_then_successes(tasks, refused_at=6)
    answers = iter([True])  # the first failure finds the database; by the second it is gone
    monkeypatch.setattr(finishing, "_database_answers", lambda: next(answers, False))

    with pytest.raises(Exception):  # noqa: B017
        finish_attempts(reports)

    # The first half landed before the outage: marked written, its 4 slots given back.
    assert [r.written is not None for r in reports] == [True] * 4 + [False] * 4
    assert [r["status"] for r in rows(tasks)] == [Status.SUCCESS] * 4 + [Status.PROCESSING] * 4
    assert held_slots(T) == 4
    monkeypatch.undo()
    assert len(finish_attempts([r for r in reports if r.written is None])) == 4
    assert held_slots(T) == 0


@pytest.mark.django_db(transaction=True)
def test_a_lone_report_whose_write_fails_once_for_a_passing_reason_is_written(monkeypatch) -> None:  # noqa: ANN001
    (task,) = claim(1)
    real, calls = sql.update_attempts, []

    def connection_lost_once(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError(2013, "Lost connection to server during query")  # and it is back
        return real(*args, **kwargs)

    monkeypatch.setattr(sql, "update_attempts", connection_lost_once)
    assert len(finish_attempts([Report(task, Outcome.SUCCESS, result="done")])) == 1
    assert rows([task])[0]["status"] == Status.SUCCESS and len(calls) == 2


def wait_for_locks_at_most_a_second() -> None:
    """This connection gives up on a lock after about a second (the session ends with the test)."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        elif connection.vendor == "postgresql":
            cursor.execute("SET lock_timeout = '1s'")
        else:
            cursor.execute("PRAGMA busy_timeout = 1000")


@pytest.mark.django_db(transaction=True)
def test_a_write_that_waits_too_long_for_a_lock_is_not_a_refusal() -> None:
    tasks = claim(3)
    reports = [Report(t, Outcome.SUCCESS, result=i) for i, t in enumerate(tasks)]
    locked, release = threading.Event(), threading.Event()

    def hold_a_row_lock() -> None:
        # On SQLite the transaction holds the whole database's write lock, which is the point too.
        with transaction.atomic():
            Task.objects.select_for_update().filter(pk=tasks[1].id).update(updated_at=timezone.now())
            locked.set()
            release.wait(30)
        connection.close()

    holder = threading.Thread(target=hold_a_row_lock)
    holder.start()
    try:
        assert locked.wait(30)
        wait_for_locks_at_most_a_second()
        with pytest.raises(DatabaseError) as raised:
            finish_attempts(reports)
        assert sql.is_lock_conflict(raised.value)
        # Nothing was failed for it, nothing written: the reports are simply tried again later.
        assert [r["status"] for r in rows(tasks)] == [Status.PROCESSING] * 3
        assert all(r.written is None for r in reports)
    finally:
        release.set()
        holder.join(30)
    connection.close()  # back to the usual lock waits
    assert len(finish_attempts(reports)) == 3
    assert [r["result"] for r in rows(tasks)] == [0, 1, 2]


@pytest.mark.django_db(transaction=True)
def test_statements_are_bounded_by_bytes_so_twenty_1mb_results_land_in_one_flush(monkeypatch) -> None:  # noqa: ANN001
    """On MariaDB one statement of 20 MB would exceed max_allowed_packet (16 MiB by default)."""
    tasks = claim(20)
    real, sizes = sql.update_attempts, []

    def measured(table: str, changes: dict[int, dict[str, Any]], *args: Any, **kwargs: Any) -> int:
        sizes.append(sum(len(json.dumps(c.get("result"))) for c in changes.values()))
        return real(table, changes, *args, **kwargs)

    monkeypatch.setattr(sql, "update_attempts", measured)
    monkeypatch.setattr(finishing, "_database_answers", lambda: pytest.fail("no statement should have failed"))
    one_mb = "x" * 1_000_000
    reports = [Report(t, Outcome.SUCCESS, result={"data": one_mb, "i": i}) for i, t in enumerate(tasks)]
    assert len(finish_attempts(reports)) == 20

    assert 5 <= len(sizes) <= 7 and max(sizes) <= finishing.MAX_STATEMENT_BYTES
    stored = Task.objects.filter(pk__in=[t.id for t in tasks], status=Status.SUCCESS)
    assert sorted(r["i"] for r in stored.values_list("result", flat=True)) == list(range(20))
    assert all(len(r["data"]) == 1_000_000 for r in stored.values_list("result", flat=True))


@pytest.mark.django_db(transaction=True)
def test_statements_are_bounded_by_rows(monkeypatch) -> None:  # noqa: ANN001
    tasks = claim(600)
    real, counts = sql.update_attempts, []

    def counted(table: str, changes: dict[int, dict[str, Any]], *args: Any, **kwargs: Any) -> int:
        counts.append(len(changes))
        return real(table, changes, *args, **kwargs)

    monkeypatch.setattr(sql, "update_attempts", counted)
    assert len(finish_attempts([Report(t, Outcome.SUCCESS) for t in tasks])) == 600
    assert counts == [500, 100]


@pytest.mark.django_db(transaction=True)
def test_repeated_reports_of_one_attempt_are_applied_once() -> None:
    """The second report of `a` shares its columns and token with `b`'s, which alone makes it
    look written by this flush (same updated_at): counted twice, it would give a slot back twice."""
    a, b = claim(2)
    reports = [
        Report(a, Outcome.SUCCESS, result="a"),
        Report(a, Outcome.ERROR, error="interrupted: the worker stopped before it finished"),
        Report(b, Outcome.ERROR, error="boom"),
    ]
    accepted = finish_attempts(reports)

    assert [(r.task.id, r.outcome) for r in accepted] == [(a.id, Outcome.SUCCESS), (b.id, Outcome.ERROR)]
    row_a, row_b = rows([a, b])
    assert (row_a["status"], row_a["result"], len(row_a["schedule_log"])) == (Status.SUCCESS, "a", 1)
    assert (row_b["status"], len(row_b["schedule_log"])) == (Status.PENDING, 1)


@pytest.mark.django_db(transaction=True)
def test_repeated_reports_of_one_attempt_give_its_limiter_slot_back_once(redis_client) -> None:  # noqa: ANN001
    ScheduleCfg.objects.update_or_create(task_type=T, defaults={"concurrency_limit": 5})
    configs.clear()
    limiter = Limiter()
    assert limiter.take(T, 1, 5).slots == 1  # a claim elsewhere holds a slot
    grant = limiter.take(T, 2, 5)
    a, b = claim(2)
    limiter.confirm(grant, [a, b])
    finish_attempts(
        [Report(a, Outcome.SUCCESS), Report(a, Outcome.ERROR, error="late"), Report(b, Outcome.ERROR, error="x")]
    )
    assert held_slots(T) == 1


@pytest.mark.django_db(transaction=True)
def test_a_superseded_running_task_stopped_by_its_retry_releases_its_dependents_at_once() -> None:
    old = taskflow.enqueue(T, {}, key="k1", version=0)
    [held] = claim_batch(configs.get(T), 1, "host-a:1:abc")
    dependent = taskflow.enqueue(T, {}, depends_on=[old.id])
    taskflow.enqueue(T, {}, key="k1", version=1)  # marks the running v0: its report stops it

    [accepted] = finish_attempts([Report(held, Outcome.ERROR, error="boom")])

    old.refresh_from_db()
    dependent.refresh_from_db()
    assert (old.status, old.status_msg) == (Status.STOPPED, "superseded by version 1")
    # Released by the report itself, not left waiting for taskwatch's repair.
    assert dependent.status == Status.STOPPED
    assert dependent.status_msg == f"dependency {old.id} was stopped (superseded by version 1)"
    assert accepted.written is not None and accepted.written["status"] == Status.STOPPED  # as written, no wake-up
