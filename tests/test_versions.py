"""Versions: once a newer version of a key is accepted, no older version starts another attempt."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

import taskflow
from taskflow.engine.attempts import ClaimedTask, Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.rescue import rescue_dead_workers, rescue_expired_attempts
from taskflow.exceptions import NextStage
from taskflow.models import ScheduleCfg, Status, Task, WorkerProcess

T = "test.noop"


def cfg() -> ScheduleCfg:
    """The type's config with retries due at once, so a requeued task could be claimed right away."""
    c = configs.get(T)
    c.retry_strategy, c.retry_interval, c.retry_jitter, c.max_retry_num = "fixed", 0.0, 0.0, 5
    return c


def claim(version: int) -> ClaimedTask:
    [held] = claim_batch(cfg(), 10, "host:1:w1")
    assert held.version == version
    return held


def finish(report: Report) -> None:
    assert finish_attempts([report], cfgs={T: cfg()}) == [report]


def row(version: int, key: str = "k") -> Task:
    return Task.objects.get(task_type=T, key=key, version=version)


def assert_stopped_by(version: int, newer: int, key: str = "k") -> None:
    task = row(version, key)
    assert task.status == Status.STOPPED
    assert task.status_msg == f"superseded by version {newer}"
    assert task.finished_at is not None and task.superseded_by == newer


@pytest.mark.django_db
def test_a_superseded_running_version_is_not_retried_after_the_newer_one_ran() -> None:
    taskflow.enqueue(T, {"v": 1}, key="k", version=1)
    v1 = claim(1)
    taskflow.enqueue(T, {"v": 2}, key="k", version=2)
    assert row(1).status == Status.PROCESSING  # its attempt goes on
    assert row(1).superseded_by == 2

    finish(Report(v1, Outcome.ERROR, error="RuntimeError: boom"))  # retries left, due at once

    assert_stopped_by(1, 2)
    assert row(1).schedule_log[0]["error"] == "RuntimeError: boom"  # the attempt is on record
    v2 = claim(2)
    finish(Report(v2, Outcome.SUCCESS, result={"v": 2}))
    assert claim_batch(cfg(), 10, "host:1:w1") == []
    assert row(2).status == Status.SUCCESS and row(1).status == Status.STOPPED


@pytest.mark.django_db
@pytest.mark.parametrize(
    "report",
    [
        {"outcome": Outcome.SNOOZE, "delay": 0},
        {"outcome": Outcome.NEXT_STAGE, "next_stage": NextStage("two", context={"n": 2})},
        {"outcome": Outcome.HANDBACK},
        {"outcome": Outcome.RESCUED, "error": "rescued: by hand"},
    ],
    ids=["snooze", "next_stage", "handback", "rescued"],
)
def test_whatever_would_queue_a_superseded_version_again_stops_it(report: dict[str, Any]) -> None:
    taskflow.enqueue(T, key="k", version=1)
    v1 = claim(1)
    taskflow.enqueue(T, key="k", version=3)
    finish(Report(v1, **report))
    assert_stopped_by(1, 3)
    assert [t.version for t in claim_batch(cfg(), 10, "host:1:w1")] == [3]


@pytest.mark.django_db
@pytest.mark.parametrize(("outcome", "status"), [(Outcome.SUCCESS, Status.SUCCESS), (Outcome.FAIL, Status.FAILED)])
def test_a_superseded_version_may_finish_its_running_attempt(outcome: Outcome, status: str) -> None:
    taskflow.enqueue(T, key="k", version=1)
    v1 = claim(1)
    taskflow.enqueue(T, key="k", version=2)
    finish(Report(v1, outcome, result={"done": 1}, error="bad input"))
    assert row(1).status == status
    assert row(2).status == Status.PENDING


@pytest.mark.django_db
def test_one_batch_stops_only_the_superseded_tasks() -> None:
    taskflow.enqueue(T, key="old", version=1)
    taskflow.enqueue(T, key="other", version=1)
    held = claim_batch(cfg(), 10, "host:1:w1")
    assert len({t.lease_token for t in held}) == 1  # one UPDATE for both reports
    taskflow.enqueue(T, key="old", version=2)

    assert len(finish_attempts([Report(t, Outcome.ERROR, error="E") for t in held], cfgs={T: cfg()})) == 2

    assert_stopped_by(1, 2, key="old")
    other = row(1, key="other")
    assert (other.status, other.superseded_by, other.finished_at) == (Status.PENDING, None, None)
    assert other.status_msg.startswith("attempt 1 failed")


@pytest.mark.django_db
@pytest.mark.parametrize("rescue", ["dead worker", "deadline"])
def test_a_rescued_superseded_version_is_stopped(rescue: str) -> None:
    taskflow.enqueue(T, key="k", version=1)
    claim(1)
    taskflow.enqueue(T, key="k", version=2)
    later = timezone.now() + timedelta(hours=1)
    if rescue == "dead worker":
        WorkerProcess.objects.create(
            worker_id="host:1:w1", host="host", pid=1, started_at=later, heartbeat_at=later - timedelta(days=1)
        )
        assert rescue_dead_workers(now=later) == 1
    else:
        # Deadlines are judged by the database's clock: move this one into the past.
        Task.objects.filter(status=Status.PROCESSING).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
        assert rescue_expired_attempts() == 1
    assert_stopped_by(1, 2)


@pytest.mark.django_db
def test_a_version_superseded_twice_names_the_newest() -> None:
    taskflow.enqueue(T, key="k", version=1)
    v1 = claim(1)
    taskflow.enqueue(T, key="k", version=2)
    taskflow.enqueue(T, key="k", version=7)
    finish(Report(v1, Outcome.ERROR, error="E"))
    assert_stopped_by(1, 7)
    assert_stopped_by(2, 7)


@pytest.mark.django_db(transaction=True)
def test_a_report_racing_the_enqueue_of_a_newer_version_still_stops_the_old_one() -> None:
    """The enqueue of v2 commits after v1's report decided to retry but before its UPDATE ran.

    The report was computed (row_changes: back to pending) while v2 did not exist yet; its UPDATE
    then meets v2's uncommitted mark on v1's row, waits for that transaction and reads the mark.
    """
    taskflow.enqueue(T, key="k", version=1)
    v1 = claim(1)
    marked, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def enqueue_v2_and_hold_the_transaction() -> None:
        try:
            with transaction.atomic():
                taskflow.enqueue(T, key="k", version=2)
                marked.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    def report_v1() -> None:
        try:
            outcome["accepted"] = finish_attempts([Report(v1, Outcome.ERROR, error="E")], cfgs={T: cfg()})
        finally:
            connection.close()

    enqueuer = threading.Thread(target=enqueue_v2_and_hold_the_transaction)
    enqueuer.start()
    assert marked.wait(timeout=30)
    reporter = threading.Thread(target=report_v1)
    reporter.start()
    time.sleep(0.3)  # lets the report reach its UPDATE, which waits on the enqueue's row lock
    release.set()
    enqueuer.join(timeout=30)
    reporter.join(timeout=30)
    assert not enqueuer.is_alive() and not reporter.is_alive()

    assert len(outcome["accepted"]) == 1
    assert_stopped_by(1, 2)
    assert row(2).status == Status.PENDING


def run_together(*works: Any) -> None:
    """Run each callable on its own thread and DB connection, released at the same moment."""
    barrier = threading.Barrier(len(works))
    errors: list[BaseException] = []

    def run(work: Any) -> None:
        try:
            barrier.wait(timeout=30)
            work()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(work,)) for work in works]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


@pytest.mark.django_db(transaction=True)
def test_under_concurrent_enqueues_and_reports_no_older_version_is_queued_again() -> None:
    """Round after round, v(n+1) is enqueued while v(n)'s failed attempt is reported, released together."""
    taskflow.enqueue(T, key="k", version=1)
    for version in range(1, 16):
        held = claim(version)
        run_together(
            lambda v=version: taskflow.enqueue(T, key="k", version=v + 1),
            lambda h=held: finish(Report(h, Outcome.ERROR, error="E")),
        )
        assert_stopped_by(version, version + 1)
    live = Task.objects.filter(task_type=T, key="k").exclude(status=Status.STOPPED)
    assert [(t.version, t.status) for t in live] == [(16, Status.PENDING)]
