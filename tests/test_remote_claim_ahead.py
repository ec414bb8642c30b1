"""Remote claim-ahead: a hold reserves attempts beyond its limit, the worker starts them (`tasks/start/`) as its
threads take them. A reserved attempt is the holder's alone to start, report or release; a worker that dies
with reserved attempts has them handed back uncounted; limited types are never reserved."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import taskflow
from taskflow.engine import remote
from taskflow.models import ScheduleCfg, Status, Task
from tests.apiclients import Api, user_with
from tests.remote_support import register_worker

T = "api.job"


def worker(name: str) -> Api:
    api = Api(user_with(name, "hold_task"))
    register_worker(api, host=f"{name}-host", task_types=(T,))
    return api


def hold(api: Api, limit: int, reserve: int) -> list[dict]:
    status, body = api.post("/api/tasks/hold/", {"task_types": [T], "limit": limit, "reserve": reserve})
    assert status == 200, body
    return body["tasks"]


def item(held: dict) -> dict:
    return {"task_id": held["task_id"], "lease": held["lease"], "attempt_key": held["attempt_key"]}


def start(api: Api, helds: list[dict]) -> list[dict]:
    status, body = api.post("/api/tasks/start/", {"items": [item(h) for h in helds]})
    assert status == 200, body
    return body["results"]


@pytest.mark.django_db
def test_a_hold_reserves_beyond_its_limit_and_start_starts_them() -> None:
    taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(5)])
    api = worker("w")
    held = hold(api, 2, 2)
    assert [h["reserved"] for h in held] == [False, False, True, True]
    rows = {t.pk: t for t in Task.objects.filter(pk__in=[int(h["task_id"]) for h in held])}
    assert all(rows[int(h["task_id"])].status == Status.PROCESSING for h in held)
    assert [rows[int(h["task_id"])].started_at is None for h in held] == [False, False, True, True]
    results = start(api, held[2:])
    assert [r["outcome"] for r in results] == ["applied", "applied"]
    assert Task.objects.filter(pk__in=[int(h["task_id"]) for h in held], started_at=None).count() == 0
    # Again (a retry whose answer was lost): still held, still applied, nothing changes.
    assert [r["outcome"] for r in start(api, held[2:])] == ["applied", "applied"]


def snapshot(task_id: int) -> dict:
    return Task.objects.filter(pk=task_id).values().get()


@pytest.mark.django_db
def test_a_reserved_attempt_is_started_by_its_holder_alone_and_only_with_its_key() -> None:
    taskflow.enqueue_many([{"task_type": T, "payload": {}} for _ in range(2)])
    owner = worker("owner")
    [first, second] = hold(owner, 0, 2)
    assert first["reserved"] and second["reserved"]
    before = snapshot(int(first["task_id"]))

    # Another user's worker with the owner's (leaked) key, the same user's other worker, a wrong key,
    # a wrong lease: each is refused as not its attempt, and the row is untouched.
    other = worker("other")
    twin = Api(owner.user)
    register_worker(twin, host="twin-host", task_types=(T,))
    forged = {**first, "attempt_key": "0" * 64}
    stale = {**first, "lease": first["lease"] - 1}
    for api, held in ((other, first), (twin, first), (owner, forged), (owner, stale)):
        assert start(api, [held]) == [{"task_id": first["task_id"], "outcome": "refused", "error": "forbidden"}]
    # Nor can anyone else report or release it.
    for path, extra in (("/api/tasks/set/", {"status": "success", "result": 1}), ("/api/tasks/release/", {})):
        status, body = other.post(path, {"items": [{**item(first), **extra}]})
        assert status == 200 and body["results"][0]["outcome"] == "refused", body
    assert snapshot(int(first["task_id"])) == before

    # Its holder starts it; a reserved attempt taken away meanwhile (released) is refused, not started.
    assert start(owner, [first]) == [{"task_id": first["task_id"], "outcome": "applied"}]
    status, body = owner.post("/api/tasks/release/", {"items": [item(second)]})
    assert body["results"][0]["outcome"] == "applied"
    assert start(owner, [second])[0]["error"] == "lease_lost"
    got = Task.objects.get(pk=int(second["task_id"]))
    assert (got.status, got.attempts, got.started_at, got.worker_id) == (Status.PENDING, 0, None, "")


@pytest.mark.django_db
def test_a_limited_type_is_never_reserved() -> None:
    taskflow.enqueue_many([{"task_type": T, "payload": {}} for _ in range(6)])
    ScheduleCfg.objects.filter(pk=T).update(concurrency_limit=2)
    from taskflow.engine.configs import configs

    configs.clear()
    api = worker("w")
    assert hold(api, 0, 5) == []
    held = hold(api, 1, 5)
    assert [h["reserved"] for h in held] == [False]
    assert Task.objects.filter(status=Status.PROCESSING, started_at=None).count() == 0


@pytest.mark.django_db
def test_reserved_attempts_a_worker_does_not_list_are_handed_back_uncounted_by_its_beat() -> None:
    taskflow.enqueue_many([{"task_type": T, "payload": {}} for _ in range(3)])
    api = worker("w")
    held = hold(api, 1, 2)
    assert [h["reserved"] for h in held] == [False, True, True]
    # The hold's answer was lost: the worker's beat lists none of them, past the grace of a hold in flight.
    past = timezone.now() - timedelta(seconds=30)
    Task.objects.filter(pk__in=[int(h["task_id"]) for h in held]).update(heartbeat_at=past)
    Task.objects.filter(pk=int(held[0]["task_id"])).update(started_at=past)
    status, body = api.post("/api/tasks/heartbeat/", {"beat": True, "items": []})
    assert status == 200 and body["handed_back"] == 3, body
    rows = Task.objects.filter(pk__in=[int(h["task_id"]) for h in held])
    assert {(t.status, t.attempts, t.started_at) for t in rows} == {(Status.PENDING, 0, None)}


@pytest.mark.django_db
def test_a_dead_remote_workers_reserved_attempts_are_handed_back_uncounted_and_its_started_one_rescued() -> None:
    from taskflow.engine.rescue import rescue_dead_workers
    from taskflow.models import WorkerProcess

    taskflow.enqueue_many([{"task_type": T, "payload": {}, "max_retries": 3} for _ in range(3)])
    api = worker("w")
    started, *reserved = hold(api, 1, 2)
    assert [h["reserved"] for h in reserved] == [True, True]
    WorkerProcess.objects.filter(worker_id=api.worker_id).update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    rescue_dead_workers()
    for held in reserved:
        got = Task.objects.get(pk=int(held["task_id"]))
        assert (got.status, got.attempts, got.started_at, got.worker_id) == (Status.PENDING, 0, None, "")
    got = Task.objects.get(pk=int(started["task_id"]))
    assert (got.status, got.attempts) == (Status.PENDING, 1)  # a failed attempt, retried by the policy
    # The dead worker's late start of a reserved attempt is refused: it was handed back.
    assert start(api, reserved)[0]["error"] == "lease_lost"


@pytest.mark.django_db
def test_hold_refuses_a_reserve_out_of_bounds() -> None:
    taskflow.enqueue(T, {})
    api = worker("w")
    for body in ({"limit": 0}, {"limit": 0, "reserve": 0}, {"limit": 1, "reserve": 1000}, {"limit": 1, "reserve": -1}):
        status, answer = api.post("/api/tasks/hold/", {"task_types": [T], **body})
        assert status == 400, (body, answer)
    with pytest.raises(taskflow.InvalidTask):
        remote.hold([T], 0, api.worker_id, reserve=0)


@pytest.mark.parametrize(
    "item",
    [
        {"status": "success", "result": {"a": [1, 2]}},
        {"status": "success", "result": None, "cost_ms": 12},
        {"status": "success", "result": "x", "cost_ms": -1},
        {"status": "success", "result": 1, "cost_ms": True},
        {"status": "success", "result": 1, "lease": "3"},
        {"status": "success", "result": 1, "attempt_key": "A" * 64},
        {"status": "success", "result": 1, "attempt_key": ""},
        {"status": "success", "result": 1, "task_id": "0"},
        {"status": "success", "result": 1, "task_id": 7},
        {"status": "success"},
        {"status": "success", "result": 1, "error": "x"},
        {"status": "success", "result": "\ud800"},
        {"status": "success", "result": float("nan")},
        {"status": "failed", "error": "x"},
    ],
)
def test_a_plain_success_report_is_validated_as_the_serializer_would(item: dict) -> None:
    from rest_framework import serializers as drf

    from taskflow.api.serializers import BatchSetItemSerializer, plain_success

    full = {"task_id": "123", "lease": 3, "attempt_key": "a" * 64, **item}
    fast = plain_success(full)
    try:
        slow = BatchSetItemSerializer().run_validation(full)
    except drf.ValidationError:
        slow = None
    # What the fast path accepts, the serializer accepts with the same values; what it doubts, the serializer judges.
    if fast is not None:
        assert slow is not None and dict(slow) == fast, (fast, slow)
    if item in ({"status": "success", "result": {"a": [1, 2]}}, {"status": "success", "result": None, "cost_ms": 12}):
        assert fast is not None  # the shapes a remote worker sends take the fast path
