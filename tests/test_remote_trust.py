"""A remote worker is trusted with its own attempts only (issue 15, item 1).

Its identity is issued by the server and bound to the user it authenticates as (worker key), and
each attempt is proven by a key given to its holder alone (attempt key). Anything else a
`hold_task` token tries, against a local worker's attempts or another remote worker's, is
refused and changes nothing; and no call makes another worker look alive. (The same attacks
against real processes: tests/test_remote_worker_processes.py.)
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.test import override_settings
from django.utils import timezone

import taskflow
from taskflow.engine import remote
from taskflow.models import ScheduleCfg, Status, Task, WorkerProcess
from taskflow.runtime.worker import new_worker_id
from tests.apiclients import Api, user_with
from tests.conftest import read_runs, wait_until
from tests.remote_support import register_worker

T = "test.sleep"
ATTACKS = ("beat", "report", "checkpoint", "heartbeat", "release", "batch")


def attacker(name: str = "attacker", *, registered: bool = True) -> Api:
    """A token with only hold_task, as every remote worker has; registered as a worker of its own."""
    api = Api(user_with(name, "hold_task"))
    if registered:
        register_worker(api, host=f"{name}-host", task_types=(T,))
    return api


def snapshot(task_id: int) -> dict:
    return Task.objects.filter(pk=task_id).values().get()


def attack(api: Api, task_id: int, lease: int, key: str, kind: str) -> tuple[int, dict]:
    """One call that would touch attempt (task_id, lease) if the server took the caller's word for it."""
    item = {"task_id": str(task_id), "lease": lease, "attempt_key": key}
    if kind == "report":
        body = {"lease": lease, "attempt_key": key, "status": "success", "result": {"forged": True}}
        return api.post(f"/api/tasks/{task_id}/set/", body)
    if kind == "checkpoint":
        return api.post(f"/api/tasks/{task_id}/set/", {"lease": lease, "attempt_key": key, "checkpoint": "forged"})
    if kind == "batch":
        return api.post("/api/tasks/set/", {"items": [{**item, "status": "failed", "error": "x", "retry": False}]})
    if kind == "heartbeat":
        return api.post("/api/tasks/heartbeat/", {"items": [item]})
    if kind == "release":
        return api.post("/api/tasks/release/", {"items": [item]})
    return api.post("/api/tasks/heartbeat/", {"beat": True, "items": [item]})


def refused(status: int, body: dict) -> bool:
    """A whole request refused (403, or 409: not held), or every item of it refused as not the caller's.

    `lease_lost` answers only a key the server did issue to the caller for that lease (so the
    caller held the attempt once): a key an attacker could present is `forbidden`.
    """
    if status in (403, 409):
        return body["error"] in ("worker_refused", "forbidden", "lease_lost")
    return status == 200 and all(
        r["outcome"] == "refused" and r["error"] in ("forbidden", "lease_lost") for r in body["results"]
    )


@pytest.fixture
def running(start_worker, run_log: Path):  # noqa: ANN001, ANN201
    """A local worker running one task (for 2 s), claimed long enough ago for a beat to hand it back."""
    task = taskflow.enqueue(T, {"seconds": 2})
    local = start_worker([T], concurrency=2)
    wait_until(lambda: any(r[0] == str(task.pk) and r[2] == "start" for r in read_runs(run_log)), 20)
    Task.objects.filter(pk=task.pk).update(started_at=timezone.now() - timedelta(seconds=30))
    return local, task


def test_a_beat_naming_a_local_worker_is_refused_and_hands_nothing_back(running, run_log: Path) -> None:
    local, task = running
    before = snapshot(task.pk)
    # The review's attack: a hold_task token beats naming the local worker (its id is in the console).
    status, body = attacker("anonymous", registered=False).post(
        "/api/tasks/heartbeat/", {"worker_id": local.worker_id, "items": []}
    )
    assert snapshot(task.pk) == before, "the beat handed the local worker's running attempt back"
    assert (status, body["error"]) == (403, "worker_refused")
    # The local worker's id in the credential header, with a made-up key.
    forger = attacker("forger", registered=False)
    forger.client.credentials(
        **forger.client._credentials, HTTP_TASKFLOW_WORKER_ID=local.worker_id, HTTP_TASKFLOW_WORKER_KEY="0" * 64
    )
    status, body = forger.post("/api/tasks/heartbeat/", {"beat": True, "items": []})
    assert (status, body["error"]) == (403, "worker_refused")
    # A registered worker naming it in the body (it is who its credential says), then beating as itself.
    api = attacker()
    status, body = api.post("/api/tasks/heartbeat/", {"worker_id": local.worker_id, "items": []})
    assert (status, body["error"]) == (400, "invalid")
    status, body = api.post("/api/tasks/heartbeat/", {"beat": True, "items": []})
    assert (status, body) == (200, {"results": [], "handed_back": 0})
    assert snapshot(task.pk) == before

    wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.SUCCESS, 20)
    runs = [r[2] for r in read_runs(run_log) if r[0] == str(task.pk)]
    assert runs == ["start", "end"]  # ran once, never twice at once
    assert Task.objects.get(pk=task.pk).result == {"slept": 2}


@pytest.mark.parametrize("kind", ATTACKS)
def test_a_report_or_call_with_a_guessed_lease_or_key_is_refused_and_changes_nothing(
    running, run_log: Path, kind: str
) -> None:
    local, task = running
    before = snapshot(task.pk)
    lease = before["lease_token"]
    # The review's forged report: a hold_task token, a guessed lease, no credential at all.
    anonymous = attacker("nobody-worker", registered=False)
    status, body = anonymous.post(f"/api/tasks/{task.pk}/set/", {"lease": 1, "status": "success", "result": {}})
    assert snapshot(task.pk) == before, "a forged report finished the local worker's attempt"
    assert status == 403
    # Then the attacker's own credential with no key, a guessed key, and the key the server would
    # give the attacker for that lease had it held it.
    api = attacker()
    for key in ("", "0" * 64, remote.attempt_key(task.pk, lease, api.worker_id)):
        status, body = attack(api, task.pk, lease, key, kind)
        if not key and kind in ("heartbeat", "release", "beat"):
            assert status == 400  # the key is part of every item
        elif not key and kind in ("report", "checkpoint"):
            assert status == 400 and "attempt_key" in body["fields"]
        elif not key:
            assert body["results"][0]["error"] == "invalid"
        else:
            assert refused(status, body), (kind, status, body)
            assert key != "0" * 64 or "lease_lost" not in str(body)  # a guessed key is not the holder's
        assert snapshot(task.pk) == before
    wait_until(lambda: Task.objects.get(pk=task.pk).status == Status.SUCCESS, 20)
    assert Task.objects.get(pk=task.pk).result == {"slept": 2}
    assert [r[2] for r in read_runs(run_log) if r[0] == str(task.pk)] == ["start", "end"]


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ATTACKS)
def test_a_hold_task_token_cannot_act_on_another_remote_workers_attempt(kind: str) -> None:
    taskflow.enqueue("api.job", {})
    owner = attacker("owner")
    status, body = owner.post("/api/tasks/hold/", {"task_types": ["api.job"], "limit": 1})
    [held] = body["tasks"]
    task_id, lease, key = int(held["task_id"]), held["lease"], held["attempt_key"]
    assert key == remote.attempt_key(task_id, lease, owner.worker_id) and len(key) == 64
    Task.objects.filter(pk=task_id).update(started_at=timezone.now() - timedelta(seconds=30))
    before = snapshot(task_id)

    # Another user's worker, even knowing the owner's attempt key (leaked): not its attempt.
    other = attacker("other")
    status, body = attack(other, task_id, lease, key, kind)
    assert refused(status, body), (status, body)
    # Another worker of the same user: still not its attempt.
    sibling = register_worker(Api(owner.user), host="sibling-host", task_types=("api.job",))
    twin = Api(owner.user)
    register_worker(twin, host="twin-host", task_types=("api.job",))
    assert twin.worker_id != sibling != owner.worker_id
    status, body = attack(twin, task_id, lease, key, kind)
    assert refused(status, body), (status, body)
    assert snapshot(task_id) == before

    # The owner's worker credential, presented by another user: refused (the key is bound to the owner).
    stolen = Api(other.user)
    stolen.client.credentials(
        **stolen.client._credentials,
        HTTP_TASKFLOW_WORKER_ID=owner.worker_id,
        HTTP_TASKFLOW_WORKER_KEY=owner.worker_key,
    )
    status, body = attack(stolen, task_id, lease, key, kind)
    assert (status, body["error"]) == (403, "worker_refused")
    status, body = stolen.post("/api/tasks/hold/", {"task_types": ["api.job"], "limit": 1})
    assert (status, body["error"]) == (403, "worker_refused")
    assert snapshot(task_id) == before

    # The owner itself can.
    status, body = attack(owner, task_id, lease, key, kind)
    assert status == 200 and (kind == "checkpoint" or kind == "report" or body["results"][0]["outcome"] == "applied")


@pytest.mark.django_db
def test_no_remote_call_makes_another_worker_look_alive() -> None:
    # Another worker (a local one's id, say) holding an attempt, and dead for five minutes.
    victim = new_worker_id()
    taskflow.enqueue(T, {})
    [claimed] = remote.hold([T], 1, victim)
    task = Task.objects.get(pk=claimed.id)
    stale = timezone.now() - timedelta(minutes=5)
    WorkerProcess.objects.filter(worker_id=victim).update(heartbeat_at=stale)
    local = type("Local", (), {"worker_id": victim})
    lease = Task.objects.get(pk=task.pk).lease_token
    # A hold_task token naming the victim, as the review did: hold and beat with its id.
    anonymous = attacker("anonymous", registered=False)
    anonymous.post("/api/tasks/hold/", {"task_types": [T], "limit": 1, "worker_id": victim})
    anonymous.post("/api/tasks/heartbeat/", {"worker_id": victim, "items": []})
    assert WorkerProcess.objects.get(worker_id=victim).heartbeat_at == stale, "a remote call kept it alive"
    api = attacker()
    calls = [
        ("/api/tasks/hold/", {"task_types": [T], "limit": 1, "worker_id": local.worker_id}),
        ("/api/tasks/heartbeat/", {"worker_id": local.worker_id, "items": []}),
        ("/api/tasks/set/", {"items": [{"task_id": str(task.pk), "lease": lease, "attempt_key": "0" * 64}]}),
        ("/api/tasks/heartbeat/", {"items": [{"task_id": str(task.pk), "lease": lease, "attempt_key": "0" * 64}]}),
    ]
    for url, body in calls:
        api.post(url, body)
    forger = attacker("forger", registered=False)
    forger.client.credentials(
        **forger.client._credentials, HTTP_TASKFLOW_WORKER_ID=local.worker_id, HTTP_TASKFLOW_WORKER_KEY="0" * 64
    )
    assert forger.post("/api/tasks/hold/", {"task_types": [T], "limit": 1})[0] == 403
    assert forger.post("/api/tasks/heartbeat/", {"beat": True, "items": []})[0] == 403
    assert WorkerProcess.objects.get(worker_id=local.worker_id).heartbeat_at == stale
    # Only the caller's own worker was registered as alive.
    alive = set(WorkerProcess.objects.filter(heartbeat_at__gt=stale).values_list("worker_id", flat=True))
    assert alive == {api.worker_id}
    assert snapshot(task.pk)["status"] == Status.PROCESSING


@pytest.mark.django_db
def test_hold_naming_unknown_task_types_creates_no_schedule_config() -> None:
    api = attacker()
    cfgs = ScheduleCfg.objects.count()
    unknown = [f"nobody.enqueued.{i}" for i in range(100)]
    for _ in range(3):
        status, body = api.post("/api/tasks/hold/", {"task_types": unknown, "limit": 10})
        assert (status, body) == (200, {"tasks": []})
    assert ScheduleCfg.objects.count() == cfgs
    # A type gets its row when it is first enqueued, and is held from then on.
    task = taskflow.enqueue(unknown[7], {})
    status, body = api.post("/api/tasks/hold/", {"task_types": unknown, "limit": 10})
    assert [t["task_id"] for t in body["tasks"]] == [str(task.pk)]
    assert ScheduleCfg.objects.count() == cfgs + 1


@pytest.mark.django_db
def test_registration_issues_an_id_bound_to_the_user_and_rotating_secret_key_revokes_it() -> None:
    api = attacker()
    assert api.worker_id.startswith("attacker-host:4242:") and len(api.worker_key) == 64
    assert WorkerProcess.objects.filter(worker_id=api.worker_id, host="attacker-host").exists()
    for body in (
        {"host": "a:b", "pid": 1, "task_types": [T], "concurrency": 1},
        {"host": "h", "pid": -1, "task_types": [T], "concurrency": 1},
        {"host": "h", "pid": 1, "task_types": [], "concurrency": 1},
        {"host": "h", "pid": 1, "task_types": [T], "concurrency": 0},
        {"host": "h", "pid": 1, "task_types": [T], "concurrency": 1, "worker_id": "mine:1:x"},
    ):
        status, answer = api.post("/api/workers/", body)
        assert (status, answer["error"]) == (400, "invalid"), body
    assert Api(user_with("producer", "add_task")).post("/api/workers/", {})[0] == 403
    assert api.post("/api/tasks/hold/", {"task_types": [T], "limit": 1})[0] == 200
    with override_settings(SECRET_KEY="a-new-secret-key-for-this-test-only-0123456789"):
        status, body = api.post("/api/tasks/hold/", {"task_types": [T], "limit": 1})
        assert (status, body["error"]) == (403, "worker_refused")


@pytest.mark.django_db
def test_the_written_out_hold_answer_is_what_drf_would_write() -> None:
    from rest_framework import serializers

    from taskflow.api.serializers import HeldAttemptSerializer

    taskflow.enqueue("api.job", {"a": 1})
    [claimed] = remote.hold(["api.job"], 1, "host:1:w")
    task = Task.objects.get(pk=claimed.id)
    serializer = HeldAttemptSerializer(task, context={"worker_id": "host:1:w"})
    assert serializer.data == serializers.ModelSerializer.to_representation(serializer, task)
    assert serializer.data["attempt_key"] == remote.attempt_key(task.id, task.lease_token, "host:1:w")
