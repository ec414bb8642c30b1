"""The taskwatch duties against the real database (and Redis when configured), one at a time."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

import taskflow
from taskflow.engine import expiry, rescue, workers
from taskflow.engine.attempts import ClaimedTask, LeaseLost, Outcome, Report, heartbeat
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.limiter import Limiter, held_slots
from taskflow.models import ScheduleCfg, Status, Task, WorkerProcess
from taskflow.runtime.worker import TooManyStuckHandlers, Worker

from .conftest import run_in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "host-a:101:abcdef"


def _cfg(task_type: str, **changes: object) -> ScheduleCfg:
    cfg = configs.get(task_type)
    ScheduleCfg.objects.filter(pk=task_type).update(**changes)
    configs.clear()
    cfg.refresh_from_db()
    return cfg


def _claim(task_type: str = "test.noop", worker_id: str = WORKER, host: str = "") -> ClaimedTask:
    (claimed,) = claim_batch(configs.get(task_type), 1, worker_id, host=host)
    return claimed


def _worker_row(worker_id: str = WORKER, *, age: float) -> None:
    beat = timezone.now() - timedelta(seconds=age)
    WorkerProcess.objects.create(worker_id=worker_id, host="host-a", pid=101, started_at=beat, heartbeat_at=beat)


# -- rescues --------------------------------------------------------------------------------------


def test_dead_worker_attempt_is_counted_requeued_and_fenced():
    task = taskflow.enqueue("test.noop")
    claimed = _claim()
    _worker_row(age=10)  # LIVENESS_TIMEOUT is 3s in the test settings

    assert rescue.rescue_dead_workers() == 1

    task.refresh_from_db()
    assert task.status == Status.PENDING
    assert task.attempts == 1  # counted at claim, not again
    assert task.lease_token == claimed.lease_token + 1
    assert task.lease_expires_at is None
    assert task.schedule_log[0]["outcome"] == "rescued"
    assert task.schedule_log[0]["worker"] == WORKER
    assert f"worker {WORKER} stopped heartbeating" in task.status_msg
    assert task.run_after > claimed.claimed_at  # back-off from the retry policy
    # The dead attempt's late report changes nothing.
    assert (
        finish_attempts(
            [Report(claimed, Outcome.SUCCESS, result={"late": True})], cfgs={"test.noop": configs.get("test.noop")}
        )
        == []
    )
    task.refresh_from_db()
    assert task.status == Status.PENDING and task.result is None
    # Idempotent: nothing left to do, and the row goes once nothing of the worker is processing.
    assert rescue.rescue_dead_workers() == 0
    assert workers.reap_dead_worker_rows() == 1
    assert not WorkerProcess.objects.exists()


def test_live_worker_keeps_its_attempts():
    taskflow.enqueue("test.noop")
    _claim()
    _worker_row(age=0.5)
    assert rescue.rescue_dead_workers() == 0
    assert workers.reap_dead_worker_rows() == 0
    assert Task.objects.get().status == Status.PROCESSING


def test_attempt_of_a_worker_without_a_row_is_rescued_once_silent_for_the_timeout():
    task = taskflow.enqueue("test.noop")
    _claim()
    assert rescue.rescue_dead_workers() == 0  # it may simply not have beaten yet
    Task.objects.filter(pk=task.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=10))
    assert rescue.rescue_dead_workers() == 1
    assert Task.objects.get(pk=task.pk).status == Status.PENDING


def test_rescue_of_the_last_allowed_attempt_fails_the_task():
    task = taskflow.enqueue("test.noop", max_retries=1)
    for _ in range(2):
        Task.objects.filter(pk=task.pk).update(run_after=timezone.now() - timedelta(seconds=1))
        _claim()
        _worker_row(age=10)
        assert rescue.rescue_dead_workers() == 1
        WorkerProcess.objects.all().delete()
    task.refresh_from_db()
    assert task.status == Status.FAILED
    assert task.attempts == 2
    assert task.status_msg.startswith("failed after 2 attempts")
    assert [e["outcome"] for e in task.schedule_log] == ["rescued", "rescued"]
    assert task.finished_at is not None


def test_expired_attempt_is_rescued_but_a_heartbeating_one_is_not():
    expired, alive = taskflow.enqueue("test.noop"), taskflow.enqueue("test.noop")
    (a, b) = claim_batch(configs.get("test.noop"), 2, WORKER)
    _worker_row(age=0)
    late = a if a.id == expired.id else b
    Task.objects.filter(pk=expired.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    assert rescue.rescue_expired_attempts() == 1
    assert Task.objects.get(pk=expired.pk).status == Status.PENDING
    assert Task.objects.get(pk=alive.pk).status == Status.PROCESSING
    assert "ran past its deadline" in Task.objects.get(pk=expired.pk).status_msg
    with pytest.raises(LeaseLost):
        heartbeat(late)
    assert rescue.rescue_expired_attempts() == 0


def test_rescue_gives_the_limiter_slot_back(redis_client):
    _cfg("test.noop", concurrency_limit=1)
    taskflow.enqueue("test.noop")
    limiter = Limiter()
    grant = limiter.take("test.noop", 1, 1)
    assert grant.slots == 1
    limiter.confirm(grant, [_claim()])
    assert limiter.take("test.noop", 1, 1).slots == 0  # the one slot is held
    _worker_row(age=10)
    assert rescue.rescue_dead_workers() == 1
    assert held_slots("test.noop") == 0
    # A second pass finds nothing, so the slot is not given back twice.
    assert rescue.rescue_dead_workers() == 0
    assert limiter.take("test.noop", 1, 1).slots == 1


def test_stalled_worker_that_beats_again_before_the_rescue_lands_keeps_its_tasks(monkeypatch):
    tasks = [taskflow.enqueue("test.noop") for _ in range(2)]
    claim_batch(configs.get("test.noop"), 2, WORKER)
    _worker_row(age=10)  # stalled (GC pause, SIGSTOP, a slow host) long enough to look dead
    finish = rescue.finish_attempts

    def beat_resumes_then_finish(*args: object, **kwargs: object) -> object:
        # The worker's beat lands after taskwatch read the rows, before its UPDATE.
        workers.beat(WORKER, "host-a", ["test.noop"], 8)
        return finish(*args, **kwargs)

    monkeypatch.setattr(rescue, "finish_attempts", beat_resumes_then_finish)
    assert rescue.rescue_dead_workers() == 0
    assert [Task.objects.get(pk=t.pk).status for t in tasks] == [Status.PROCESSING] * 2
    monkeypatch.undo()
    assert rescue.rescue_dead_workers() == 0  # and it is alive now
    assert workers.reap_dead_worker_rows() == 0


def test_attempt_without_a_worker_row_that_heartbeats_before_the_rescue_lands_is_kept(monkeypatch):
    task = taskflow.enqueue("test.noop")
    claimed = _claim()
    Task.objects.filter(pk=task.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=10))
    finish = rescue.finish_attempts

    def handler_heartbeats_then_finish(*args: object, **kwargs: object) -> object:
        heartbeat(claimed)
        return finish(*args, **kwargs)

    monkeypatch.setattr(rescue, "finish_attempts", handler_heartbeats_then_finish)
    assert rescue.rescue_dead_workers() == 0
    assert Task.objects.get(pk=task.pk).status == Status.PROCESSING


def skewed_clock(monkeypatch, seconds: float) -> None:  # noqa: ANN001
    """Make this host's clock `seconds` off (the database's clock stays right)."""
    real = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real() + timedelta(seconds=seconds))


def test_a_worker_host_with_a_slow_clock_does_not_look_dead(monkeypatch):
    taskflow.enqueue("test.noop")
    _claim()
    with monkeypatch.context() as on_the_worker_host:
        skewed_clock(on_the_worker_host, -600)
        workers.beat(WORKER, "host-a", ["test.noop"], 8)
    assert rescue.rescue_dead_workers() == 0
    assert workers.reap_dead_worker_rows() == 0
    assert Task.objects.get().status == Status.PROCESSING


def test_a_watcher_host_with_a_fast_clock_rescues_nothing_early(monkeypatch):
    taskflow.enqueue("test.noop", timeout=60)
    _claim()
    workers.beat(WORKER, "host-a", ["test.noop"], 8)
    skewed_clock(monkeypatch, 600)
    assert rescue.rescue_dead_workers() == 0
    assert rescue.rescue_expired_attempts() == 0
    assert workers.reap_dead_worker_rows() == 0
    assert Task.objects.get().status == Status.PROCESSING


def test_rescued_task_asking_for_host_affinity_prefers_its_first_host():
    wants = taskflow.enqueue("test.noop", retry_same_host=60)
    anywhere = taskflow.enqueue("test.noop")
    claim_batch(configs.get("test.noop"), 2, WORKER)
    _worker_row(age=10)
    assert rescue.rescue_dead_workers() == 2

    wants.refresh_from_db()
    anywhere.refresh_from_db()
    assert wants.prefer_host == "host-a"
    assert timedelta(seconds=55) < wants.prefer_host_until - timezone.now() <= timedelta(seconds=60)
    assert anywhere.prefer_host == ""
    Task.objects.update(run_after=timezone.now())
    other = claim_batch(configs.get("test.noop"), 2, "host-b:1:x", host="host-b")
    assert [t.id for t in other] == [anywhere.id]
    assert [t.id for t in claim_batch(configs.get("test.noop"), 2, "host-a:2:y", host="host-a")] == [wants.id]


# -- lifetimes ------------------------------------------------------------------------------------


def test_pending_past_its_timeout_fails_unless_the_type_is_paused():
    _cfg("test.noop", pending_timeout=60)
    _cfg("test.record", pending_timeout=60, paused=True)
    stale = taskflow.enqueue("test.noop", run_after=-120)
    fresh = taskflow.enqueue("test.noop", run_after=-30)
    later = taskflow.enqueue("test.noop", run_after=600)
    paused = taskflow.enqueue("test.record", run_after=-120)
    other = taskflow.enqueue("test.fail", run_after=-(10**6))  # pending_timeout 0: never

    assert expiry.fail_stale_pending() == 1
    assert expiry.fail_stale_pending() == 0
    statuses = dict(Task.objects.values_list("id", "status"))
    assert statuses[stale.id] == Status.FAILED
    assert {statuses[t.id] for t in (fresh, later, paused, other)} == {Status.PENDING}
    assert "pending timeout" in Task.objects.get(pk=stale.pk).status_msg


def test_success_past_its_retention_becomes_stopped():
    _cfg("test.noop", success_retention=3600)
    old, new = taskflow.enqueue("test.noop"), taskflow.enqueue("test.noop")
    Task.objects.update(status=Status.SUCCESS, result={"ok": 1})
    Task.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(hours=2))

    assert expiry.expire_successes() == 1
    assert expiry.expire_successes() == 0
    old.refresh_from_db()
    assert old.status == Status.STOPPED and old.result == {"ok": 1}
    assert Task.objects.get(pk=new.pk).status == Status.SUCCESS


@override_settings(TASKFLOW={"PURGE_BATCH": 3})
def test_purge_deletes_old_failed_and_stopped_in_batches():
    _cfg("test.noop", purge_after_days=2)
    old = [taskflow.enqueue("test.noop") for _ in range(10)]
    recent = taskflow.enqueue("test.noop")
    old_pending = taskflow.enqueue("test.noop")
    Task.objects.filter(pk__in=[t.pk for t in old[:5]]).update(status=Status.FAILED)
    Task.objects.filter(pk__in=[t.pk for t in old[5:]] + [recent.pk]).update(status=Status.STOPPED)
    Task.objects.exclude(pk=recent.pk).update(finished_at=timezone.now() - timedelta(days=3))
    statements: list[str] = []

    from django.db import connection

    with connection.execute_wrapper(lambda execute, sql, *a: statements.append(sql) or execute(sql, *a)):
        assert expiry.purge_finished() == 10
    # (Each batch also deletes the dependency edges of the tasks it deleted, from their own table.)
    deletes = [s for s in statements if re.match(r"\s*DELETE FROM [`\"]?taskflow_task[`\"]? ", s, re.I)]
    assert len(deletes) == 4  # 3 + 3 + 3 + 1 rows, by primary key
    assert set(Task.objects.values_list("id", flat=True)) == {recent.id, old_pending.id}
    assert expiry.purge_finished() == 0


def test_purge_stops_between_batches_when_told():
    _cfg("test.noop", purge_after_days=1)
    for _ in range(5):
        taskflow.enqueue("test.noop")
    Task.objects.update(status=Status.FAILED, finished_at=timezone.now() - timedelta(days=2))
    batches = iter([True, False])
    with override_settings(TASKFLOW={"PURGE_BATCH": 2}):
        assert expiry.purge_finished(keep_going=lambda: next(batches)) == 2
    assert Task.objects.count() == 3


def test_taskwatch_once_makes_one_pass():
    _cfg("test.noop", pending_timeout=1)
    task = taskflow.enqueue("test.noop", run_after=-5)
    call_command("taskwatch", "--once")
    assert Task.objects.get(pk=task.pk).status == Status.FAILED


# -- the worker's side of a stuck handler ---------------------------------------------------------


def test_worker_replaces_a_handler_thread_stuck_past_its_deadline():
    stuck = taskflow.enqueue("test.sleep", {"seconds": 4}, timeout=1)
    worker = Worker(["test.sleep", "test.record"], concurrency=1)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Task.objects.get(pk=stuck.pk).status == Status.PROCESSING, timeout=20)
        others = [taskflow.enqueue("test.record", {"n": n}) for n in range(3)]
        # With its only slot held by a stuck thread the worker still runs the rest, soon after the deadline.
        wait_until(lambda: Task.objects.filter(pk__in=[t.pk for t in others], status=Status.SUCCESS).count() == 3)
        assert Task.objects.get(pk=stuck.pk).status == Status.PROCESSING
        # Nobody took the stuck task away, so its late report still counts, and its slot evens out.
        wait_until(lambda: Task.objects.get(pk=stuck.pk).status == Status.SUCCESS, timeout=20)
        wait_until(lambda: worker.in_flight == 0 and not worker._stuck)
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_worker_stops_when_too_many_handlers_are_stuck():
    for _ in range(2):
        taskflow.enqueue("test.sleep", {"seconds": 3}, timeout=1)
    worker = Worker(["test.sleep"], concurrency=1, max_stuck=1, grace=1)
    thread, raised = run_in_thread(worker)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the worker kept running with every handler stuck"
    assert [type(e) for e in raised] == [TooManyStuckHandlers]
    # Both tasks stay processing: taskwatch rescues them once past their deadlines.
    assert Task.objects.filter(status=Status.PROCESSING).count() == 2


@pytest.mark.processes
def test_pausing_a_type_stops_claims_without_touching_running_tasks(spawn, run_log):
    from .conftest import read_runs

    running = taskflow.enqueue("test.sleep", {"seconds": 3})
    spawn("taskworker", "--types", "test.sleep", "--concurrency", "4")
    wait_until(lambda: Task.objects.get(pk=running.pk).status == Status.PROCESSING, timeout=60)
    ScheduleCfg.objects.filter(pk="test.sleep").update(paused=True)
    time.sleep(1.0)  # CONFIG_REFRESH (0.2s) + one poll (0.2s), with room to spare
    waiting = taskflow.enqueue("test.sleep", {"seconds": 0})
    # The running task finishes as usual, while the new one is not claimed.
    wait_until(lambda: Task.objects.get(pk=running.pk).status == Status.SUCCESS, timeout=30)
    time.sleep(1.0)
    assert Task.objects.get(pk=waiting.pk).status == Status.PENDING
    ScheduleCfg.objects.filter(pk="test.sleep").update(paused=False)
    wait_until(lambda: Task.objects.get(pk=waiting.pk).status == Status.SUCCESS, timeout=30)
    assert sorted(r[0] for r in read_runs(run_log) if r[2] == "start") == sorted([str(running.pk), str(waiting.pk)])
