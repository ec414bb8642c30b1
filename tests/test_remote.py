"""engine/remote.py: remote workers' claims, reports, heartbeats and hand-backs, named by task id and lease."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

import taskflow
from taskflow.engine import limiter, remote
from taskflow.engine.attempts import Outcome
from taskflow.engine.configs import configs
from taskflow.exceptions import InvalidTask
from taskflow.models import ScheduleCfg, Status, Task, WorkerProcess
from taskflow.runtime.worker import new_worker_id

pytestmark = pytest.mark.django_db
T = "remote.job"
W = "host-r:7:abc"


def held(task) -> remote.Held:  # noqa: ANN001
    return remote.Held(task.id, task.lease_token, remote.attempt_key(task.id, task.lease_token, W))


def test_worker_ids_look_like_local_ones() -> None:
    assert remote.validate_worker_id(new_worker_id())
    for bad in ("", " x", "a b", "x\n", "w" * 201, None, 5, "-flag"):
        with pytest.raises(InvalidTask):
            remote.validate_worker_id(bad)


def test_hold_takes_at_most_limit_in_all_and_schedule_limit_per_type() -> None:
    taskflow.enqueue_many([{"task_type": T}] * 5 + [{"task_type": "remote.other"}] * 5)
    ScheduleCfg.objects.filter(task_type=T).update(schedule_limit=2)
    configs.clear()
    first = remote.hold([T, "remote.other"], 6, W)
    kinds = [t.task_type for t in first]
    assert len(first) == 6 and kinds.count(T) <= 2
    assert len(remote.hold([T], 100, W)) == 2  # the type's schedule_limit per call
    for bad in ([], ["bad type"], [f"t{i}" for i in range(101)]):
        with pytest.raises(InvalidTask):
            remote.hold(bad, 1, W)
    for limit in (0, 1001, True, 1.5):
        with pytest.raises(InvalidTask):
            remote.hold([T], limit, W)  # type: ignore[arg-type]


def test_a_report_repeated_in_one_call_or_a_later_one_is_applied_once() -> None:
    taskflow.enqueue(T)
    [task] = remote.hold([T], 1, W)
    report = remote.RemoteReport(held(task), Outcome.SUCCESS, result=1)
    assert remote.finish(W, [report, report]) == [None, remote.Refused.LEASE_LOST]
    assert remote.finish(W, [report]) == [remote.Refused.LEASE_LOST]
    assert Task.objects.get(pk=task.id).status == Status.SUCCESS


def test_an_unstorable_checkpoint_writes_nothing_and_a_stale_lease_extends_nothing() -> None:
    taskflow.enqueue(T)
    [task] = remote.hold([T], 1, W)
    with pytest.raises(InvalidTask):
        remote.extend(W, [(held(task), ...), (held(task), {"bad": float("nan")})])
    before = Task.objects.get(pk=task.id)
    stale = remote.Held(task.id, task.lease_token + 1, remote.attempt_key(task.id, task.lease_token + 1, W))
    assert remote.extend(W, [(stale, {"c": 1})]) == [remote.Refused.LEASE_LOST]
    after = Task.objects.get(pk=task.id)
    assert (after.checkpoint, after.lease_expires_at) == (before.checkpoint, before.lease_expires_at)
    [deadline] = remote.extend(W, [(held(task), {"c": 2})])
    assert deadline is not None and Task.objects.get(pk=task.id).checkpoint == {"c": 2}


def test_a_remote_worker_cannot_report_what_only_the_server_decides() -> None:
    taskflow.enqueue(T)
    [task] = remote.hold([T], 1, W)
    for outcome in (Outcome.RESCUED, Outcome.TERMINATED, Outcome.LOST):
        with pytest.raises(InvalidTask):
            remote.finish(W, [remote.RemoteReport(held(task), outcome)])
    assert Task.objects.get(pk=task.id).status == Status.PROCESSING


def test_limited_types_hold_redis_slots_until_the_report(redis_client, django_capture_on_commit_callbacks) -> None:  # noqa: ANN001
    taskflow.enqueue_many([{"task_type": T}] * 4)
    ScheduleCfg.objects.filter(task_type=T).update(concurrency_limit=3)
    configs.clear()
    with django_capture_on_commit_callbacks(execute=True):
        tasks = remote.hold([T], 10, W)
    assert len(tasks) == 3 and limiter.held_slots(T) == 3
    assert remote.hold([T], 10, W) == []
    with django_capture_on_commit_callbacks(execute=True):
        assert remote.release(W, [held(t) for t in tasks[:2]]) == [None, None]
    assert limiter.held_slots(T) == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert len(remote.hold([T], 10, W)) == 2


def test_calls_beat_for_their_worker_at_most_once_per_interval_and_its_own_beat_always() -> None:
    def aged() -> None:
        WorkerProcess.objects.filter(worker_id=W).update(heartbeat_at=timezone.now() - timedelta(minutes=5))

    def fresh() -> bool:
        return WorkerProcess.objects.get(worker_id=W).heartbeat_at > timezone.now() - timedelta(seconds=30)

    taskflow.enqueue(T)
    [task] = remote.hold([T], 1, W)  # registers it
    aged()
    assert remote.extend(W, [(held(task), ...)]) != [remote.Refused.LEASE_LOST]
    assert remote.hold([T], 1, W) == []
    assert not fresh(), "a beat was written again within the interval"
    remote.beat(W)  # the worker's own liveness beat
    assert fresh()
    aged()
    time.sleep(remote._beat_every() + 0.05)
    assert remote.hold([T], 1, W) == []
    assert fresh()


def test_keys_are_the_salted_hmacs_of_the_current_secret_key() -> None:
    from django.test import override_settings
    from django.utils.crypto import salted_hmac

    def expected(salt: str, value: str) -> str:
        return salted_hmac(salt, value, algorithm="sha256").hexdigest()

    assert remote.attempt_key(7, 2, W) == expected(remote.ATTEMPT_KEY_SALT, f"7:2:{W}")
    before = remote.worker_key(1, W)
    assert before == expected(remote.WORKER_KEY_SALT, f"1:{W}")
    with override_settings(SECRET_KEY="a-rotated-secret-key-" + "x" * 40):
        assert remote.worker_key(1, W) == expected(remote.WORKER_KEY_SALT, f"1:{W}") != before
    assert remote.worker_key(1, W) == before
