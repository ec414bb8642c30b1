"""The HTTP API for remote workers (hold, report, heartbeat, release) and for operators (set without a lease)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import taskflow
from taskflow.api.serializers import HeldTaskSerializer
from taskflow.engine import remote, rescue
from taskflow.engine.configs import configs
from taskflow.models import ScheduleCfg, Status, Task, TaskEvent, WorkerProcess
from tests.apiclients import Api, api_as
from tests.remote_support import register_worker

pytestmark = pytest.mark.django_db
T = "api.job"


def registered(api: Api, host: str = "remote-host") -> Api:
    register_worker(api, host=host)
    return api


@pytest.fixture
def worker() -> Api:
    return registered(api_as("worker"))


@pytest.fixture
def operator() -> Api:
    return api_as("operator")


def hold(api: Api, limit: int = 10, types: list[str] | None = None) -> list[dict]:
    status, body = api.post("/api/tasks/hold/", {"task_types": types or [T], "limit": limit})
    assert status == 200, body
    return body["tasks"]


def fence(held: dict, **changes: object) -> dict:
    """What names an attempt in a batch: task, lease and the attempt key the hold gave."""
    return {"task_id": held["task_id"], "lease": held["lease"], "attempt_key": held["attempt_key"], **changes}


def report(api: Api, held: dict, **body: object) -> tuple[int, dict]:
    return api.post(
        f"/api/tasks/{held['task_id']}/set/", {"lease": held["lease"], "attempt_key": held["attempt_key"], **body}
    )


def row(held: dict) -> Task:
    return Task.objects.get(pk=int(held["task_id"]))


# -- hold --------------------------------------------------------------------------------------------------


def test_hold_claims_due_tasks_with_their_leases_and_registers_the_worker(worker: Api) -> None:
    tasks = [taskflow.enqueue(T, {"i": i}) for i in range(3)]
    taskflow.enqueue(T, run_after=timedelta(hours=1))
    taskflow.enqueue("api.other")
    held = hold(worker, limit=2)
    assert len(held) == 2 and {h["task_id"] for h in held} <= {str(t.id) for t in tasks}
    for h in held:
        task = row(h)
        assert (task.status, task.worker_id, task.attempts) == (Status.PROCESSING, worker.worker_id, 1)
        assert h["lease"] == task.lease_token and h["status"] == "processing" and len(h["attempt_key"]) == 64
        assert h["lease_expires_at"] is not None and h["payload"] in ({"i": 0}, {"i": 1}, {"i": 2})
    assert len(hold(worker, limit=10)) == 1
    assert hold(worker, limit=10) == []
    process = WorkerProcess.objects.get(worker_id=worker.worker_id)
    assert process.host == "remote-host" and process.task_types == [T]
    assert worker.worker_id.startswith("remote-host:4242:")


@pytest.mark.parametrize("claim", ["started", "reserved", "limited"])
def test_a_held_task_is_answered_as_get_shows_it_after_the_claim(worker: Api, claim: str) -> None:
    """The answer is built from what the claim read and wrote, not read again: it must match the row."""
    task = taskflow.enqueue(
        T,
        {"p": [1, "two"]},
        key="held-k",
        version=3,
        priority=7,
        stage="second",
        context={"c": 1},
        trace_id="t-held",
        user_id="u-held",
        max_retries=4,
        timeout=90,
    )
    # A task back from a failed attempt: a status message, a checkpoint and a count of attempts; and
    # a result and end time a claim leaves as they are (the answer must show the row's, not guess them).
    earlier = timezone.now() - timedelta(minutes=5)
    Task.objects.filter(pk=task.id).update(
        status_msg="failed once", checkpoint={"at": 2}, attempts=1, result={"r": [1.5, None]}, finished_at=earlier
    )
    body: dict = {"task_types": [T], "limit": 0 if claim == "reserved" else 1}
    if claim == "reserved":
        body["reserve"] = 1
    if claim == "limited":
        ScheduleCfg.objects.filter(task_type=T).update(concurrency_limit=3)
        configs.clear()
    status, answer = worker.post("/api/tasks/hold/", body)
    assert status == 200, answer
    [held] = answer["tasks"]
    status, shown = api_as("producer").get(f"/api/tasks/{task.id}/")
    assert status == 200
    assert {k: v for k, v in held.items() if k not in ("lease", "lease_expires_at", "attempt_key", "reserved")} == shown
    assert held["attempts"] == 2 and held["status"] == "processing" and held["max_retries"] == 4
    assert held["result"] == {"r": [1.5, None]} and held["status_msg"] == "failed once"
    assert held["reserved"] is (claim == "reserved") and (held["started_at"] is None) is (claim == "reserved")
    assert held["lease"] == row(held).lease_token
    assert held["lease_expires_at"] == HeldTaskSerializer(row(held)).data["lease_expires_at"]


def test_a_held_task_of_defaults_shows_null_max_retries_and_timeout_as_get_does(worker: Api) -> None:
    task = taskflow.enqueue(T)
    [held] = hold(worker)
    status, shown = api_as("producer").get(f"/api/tasks/{task.id}/")
    assert status == 200 and held["max_retries"] is None and held["timeout"] is None
    assert {k: v for k, v in held.items() if k not in ("lease", "lease_expires_at", "attempt_key", "reserved")} == shown


def test_hold_skips_paused_types_and_respects_concurrency_limits(worker: Api) -> None:
    taskflow.enqueue_many([{"task_type": T}] * 3 + [{"task_type": "api.paused"}] * 2)
    ScheduleCfg.objects.filter(task_type="api.paused").update(paused=True)
    ScheduleCfg.objects.filter(task_type=T).update(concurrency_limit=2)
    configs.clear()
    assert len(hold(worker, limit=10, types=[T, "api.paused"])) == 2
    assert hold(worker, limit=10, types=[T, "api.paused"]) == []
    assert Task.objects.filter(status=Status.PENDING).count() == 3


BAD_HOLDS = [
    ({"task_types": [T], "limit": 0}, "limit"),
    ({"task_types": [T], "limit": 100_000}, "limit"),
    ({"task_types": [T], "limit": "5"}, "limit"),
    ({"task_types": [T]}, "limit"),
    ({"task_types": [], "limit": 1}, "task_types"),
    ({"task_types": ["no spaces"], "limit": 1}, "task_types[0]"),
    ({"task_types": T, "limit": 1}, "task_types"),
    ({"limit": 1}, "task_types"),
    # The worker is who its credential proves, never a name in the body.
    ({"task_types": [T], "limit": 1, "worker_id": "other-host:1:abc"}, "worker_id"),
    ({"task_types": [T], "limit": 1, "extra": 1}, "extra"),
]


@pytest.mark.parametrize(("body", "field"), BAD_HOLDS)
def test_bad_holds_are_400s_and_claim_nothing(worker: Api, body: dict, field: str) -> None:
    task = taskflow.enqueue(T)
    status, answer = worker.post("/api/tasks/hold/", body)
    assert (status, answer["error"]) == (400, "invalid") and field in answer["fields"], answer
    task.refresh_from_db()
    assert task.status == Status.PENDING
    assert list(WorkerProcess.objects.values_list("worker_id", flat=True)) == [worker.worker_id]


# -- worker reports through the single set ----------------------------------------------------------------


def test_a_success_report_finishes_the_task_once_and_a_repeat_is_lease_lost(worker: Api) -> None:
    taskflow.enqueue(T)
    [held] = hold(worker)
    status, body = report(worker, held, status="success", result={"answer": 42}, cost_ms=12)
    assert status == 200 and body["status"] == "success" and body["result"] == {"answer": 42}
    task = row(held)
    assert task.status == Status.SUCCESS and task.schedule_log[0]["cost_ms"] == 12
    status, body = report(worker, held, status="success", result={"answer": 43})
    assert (status, body["error"]) == (409, "lease_lost")
    assert row(held).result == {"answer": 42}


def test_a_failed_report_is_retried_by_the_policy_unless_retry_is_false(worker: Api) -> None:
    taskflow.enqueue(T, max_retries=3)
    [held] = hold(worker)
    status, body = report(worker, held, status="failed", error="boom", detail="Traceback ...")
    assert status == 200 and body["status"] == "pending" and "boom" in body["status_msg"]
    assert row(held).attempts == 1
    row(held).__class__.objects.filter(pk=row(held).pk).update(run_after=timezone.now())
    [again] = hold(worker)
    assert again["attempts"] == 2 and again["lease"] > held["lease"]
    status, body = report(worker, again, status="failed", error="for good", retry=False)
    assert status == 200 and body["status"] == "failed" and body["finished_at"] is not None


def test_a_stage_report_moves_the_task_to_its_next_stage(worker: Api) -> None:
    taskflow.enqueue(T, stage="fetch", priority=1)
    [held] = hold(worker)
    status, body = report(worker, held, stage="parse", context={"rows": 3}, delay=0, priority=9)
    assert status == 200
    assert (body["status"], body["stage"], body["context"], body["priority"], body["attempts"]) == (
        "pending",
        "parse",
        {"rows": 3},
        9,
        0,
    )
    [next_stage] = hold(worker)
    assert next_stage["stage"] == "parse" and next_stage["context"] == {"rows": 3}


def test_a_checkpoint_alone_saves_progress_and_extends_the_lease(worker: Api) -> None:
    taskflow.enqueue(T, timeout=60)
    [held] = hold(worker)
    Task.objects.filter(pk=int(held["task_id"])).update(lease_expires_at=timezone.now() + timedelta(seconds=5))
    status, body = report(worker, held, checkpoint={"done": 10})
    assert status == 200 and body["checkpoint"] == {"done": 10} and body["status"] == "processing"
    assert body["lease"] == held["lease"] and body["lease_expires_at"] > held["lease_expires_at"]
    assert row(held).lease_expires_at > timezone.now() + timedelta(seconds=50)


def test_a_snooze_report_requeues_without_using_an_attempt(worker: Api) -> None:
    taskflow.enqueue(T)
    [held] = hold(worker)
    status, body = report(worker, held, status="pending", delay=30, error="waiting for upstream")
    assert status == 200 and body["status"] == "pending" and body["attempts"] == 0
    assert row(held).run_after > timezone.now() + timedelta(seconds=25)


def test_a_zombie_report_after_the_task_was_rescued_and_claimed_again_is_refused(worker: Api) -> None:
    taskflow.enqueue(T, max_retries=5)
    fast = registered(Api(worker.user), host="fast-host")
    [first] = hold(worker)
    Task.objects.filter(pk=int(first["task_id"])).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert rescue.rescue_expired_attempts() == 1
    Task.objects.filter(pk=int(first["task_id"])).update(run_after=timezone.now())
    [second] = hold(fast)
    assert second["task_id"] == first["task_id"] and second["lease"] > first["lease"]

    for body in ({"status": "success", "result": "zombie"}, {"checkpoint": 1}, {"stage": "x"}):
        status, answer = report(worker, first, **body)
        assert (status, answer["error"]) == (409, "lease_lost")
    task = row(second)
    assert (task.status, task.worker_id, task.result, task.checkpoint) == (
        Status.PROCESSING,
        fast.worker_id,
        None,
        None,
    )
    # The slow worker cannot report the fast one's attempt even with its key: it is not its holder.
    assert report(worker, second, status="success", result="stolen")[0] == 403
    assert report(fast, second, status="success", result="live")[0] == 200
    assert row(second).result == "live"


def test_a_report_on_a_task_stopped_by_an_operator_is_lease_lost(worker: Api) -> None:
    taskflow.enqueue(T)
    [held] = hold(worker)
    taskflow.terminate([int(held["task_id"])], by="ops")
    assert report(worker, held, status="success", result=1)[0] == 409
    assert row(held).status == Status.STOPPED


BAD_REPORTS = [
    ({"status": "success"}, "result"),
    ({"status": "stopped"}, "status"),
    ({"status": "success", "result": 1, "error": "x"}, "error"),
    ({"status": "failed", "retry": "no"}, "retry"),
    ({"status": "failed", "result": 1}, "result"),
    ({"stage": "s" * 101}, "stage"),
    ({"stage": "next", "delay": -1}, "delay"),
    ({"stage": "next", "delay": 366 * 86400}, "delay"),
    ({"stage": "next", "priority": 101}, "priority"),
    ({"stage": "next", "checkpoint": 1}, "checkpoint"),
    ({"status": "success", "result": "\u0000"}, "result"),
    ({"checkpoint": 1, "run_after": 5}, "run_after"),
    ({}, "non_field_errors"),
]


@pytest.mark.parametrize(("body", "field"), BAD_REPORTS)
def test_malformed_reports_are_400s_and_change_nothing(worker: Api, body: dict, field: str) -> None:
    taskflow.enqueue(T)
    [held] = hold(worker)
    status, answer = report(worker, held, **body)
    assert (status, answer["error"]) == (400, "invalid") and field in answer["fields"], answer
    task = row(held)
    assert task.status == Status.PROCESSING and task.lease_token == held["lease"]


def test_a_report_for_an_unknown_task_is_404_and_a_lease_not_given_403(worker: Api) -> None:
    taskflow.enqueue(T)
    [held] = hold(worker)
    status, body = worker.post("/api/tasks/999/set/", {"lease": 1, "status": "success", "result": 1})
    assert (status, body["error"]) == (404, "not_found")
    status, body = report(worker, {**held, "lease": held["lease"] + 1}, status="success", result=1)
    assert (status, body["error"]) == (403, "forbidden")
    status, body = worker.post(f"/api/tasks/{held['task_id']}/set/", {"lease": held["lease"], "checkpoint": 1})
    assert (status, body["error"]) == (400, "invalid") and "attempt_key" in body["fields"]
    assert row(held).status == Status.PROCESSING and row(held).checkpoint is None


def test_worker_reports_need_hold_task_and_operator_changes_operate_task(worker: Api, operator: Api) -> None:
    task = taskflow.enqueue(T)
    [held] = hold(worker)
    status, body = report(operator, held, status="success", result=1)
    assert (status, body["error"]) == (403, "permission_denied")
    status, body = worker.post(f"/api/tasks/{task.id}/set/", {"status": "stopped"})
    assert (status, body["error"]) == (403, "permission_denied")
    assert api_as("producer").post(f"/api/tasks/{task.id}/set/", {"priority": 3})[0] == 403
    assert api_as("nobody").post(f"/api/tasks/{task.id}/set/", {"lease": 1, "checkpoint": 1})[0] == 403
    assert row(held).status == Status.PROCESSING


# -- operator changes through the single set -------------------------------------------------------------


def events(task_id: int) -> list[tuple[str, str, str]]:
    return list(TaskEvent.objects.filter(task_id=task_id).values_list("action", "actor", "reason"))


def test_operators_stop_retry_reschedule_and_reprioritise_with_an_audit_trail(operator: Api) -> None:
    task = taskflow.enqueue(T)
    url = f"/api/tasks/{task.id}/set/"
    status, body = operator.post(url, {"status": "stopped", "reason": "bad input"})
    assert status == 200 and body["status"] == "stopped" and "bad input" in body["status_msg"]
    status, body = operator.post(url, {"status": "pending"})
    assert status == 200 and body["status"] == "pending"
    status, body = operator.post(url, {"run_after": "2031-05-06T07:08:09Z", "reason": "later"})
    assert status == 200 and body["run_after"].startswith("2031-05-06T07:08:09")
    status, body = operator.post(url, {"priority": -7})
    assert status == 200 and body["priority"] == -7
    status, body = operator.post(url, {"max_retries": 9})
    assert status == 200 and body["max_retries"] == 9
    assert events(task.id) == [
        ("terminate", "operator", "bad input"),
        ("retry_now", "operator", ""),
        ("reschedule", "operator", "later"),
        ("set_priority", "operator", ""),
        ("set_max_retries", "operator", ""),
    ]


def test_an_operator_change_that_does_not_apply_is_409_not_applicable(operator: Api, worker: Api) -> None:
    task = taskflow.enqueue(T)
    [held] = hold(worker)
    report(worker, held, status="success", result=None)
    url = f"/api/tasks/{task.id}/set/"
    for change in ({"status": "stopped"}, {"status": "pending"}, {"max_retries": 5}, {"run_after": 10}):
        status, body = operator.post(url, change)
        assert (status, body["error"]) == (409, "not_applicable"), change
    other = taskflow.enqueue(T)
    status, body = operator.post(f"/api/tasks/{other.id}/set/", {"priority": 0})
    assert (status, body["error"]) == (409, "not_applicable") and "unchanged" in body["detail"]
    assert not TaskEvent.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"reason": "why"},
        {"status": "stopped", "priority": 1},
        {"status": "success"},
        {"status": "stopped", "result": 1},
        {"priority": 200},
        {"max_retries": -1},
        {"run_after": "soon"},
        {"status": "stopped", "reason": 5},
    ],
)
def test_malformed_operator_changes_are_400s_and_change_nothing(operator: Api, body: dict) -> None:
    task = taskflow.enqueue(T)
    status, answer = operator.post(f"/api/tasks/{task.id}/set/", body)
    assert (status, answer["error"]) == (400, "invalid"), answer
    task.refresh_from_db()
    assert task.status == Status.PENDING and not TaskEvent.objects.exists()


# -- batches ---------------------------------------------------------------------------------------------


def test_batch_set_applies_each_report_and_refuses_stale_or_invalid_ones_alone(worker: Api) -> None:
    taskflow.enqueue_many([{"task_type": T, "max_retries": 2}] * 4)
    a, b, c, d = hold(worker)
    taskflow.terminate([int(b["task_id"])], by="ops")
    items = [
        fence(a, status="success", result="A"),
        fence(b, status="success", result="B"),
        fence(c, status="failed", error="x", retry=False),
        fence(d, status="success"),
        fence(d, checkpoint={"at": 3}),
        fence(a, status="success", result="again"),
        {"task_id": "999", "lease": 1, "attempt_key": "0" * 64, "stage": "next"},
        fence(d, lease=d["lease"] + 1, checkpoint={"at": 4}),
        {**fence(d), "checkpoint": {"at": 5}, "attempt_key": a["attempt_key"]},
    ]
    status, body = worker.post("/api/tasks/set/", {"items": items})
    assert status == 200
    outcomes = [(r["task_id"], r["outcome"], r.get("error")) for r in body["results"]]
    assert outcomes == [
        (a["task_id"], "applied", None),
        (b["task_id"], "refused", "lease_lost"),
        (c["task_id"], "applied", None),
        (d["task_id"], "refused", "invalid"),
        (d["task_id"], "applied", None),
        (a["task_id"], "refused", "lease_lost"),
        ("999", "refused", "forbidden"),
        (d["task_id"], "refused", "forbidden"),
        (d["task_id"], "refused", "forbidden"),
    ]
    assert [row(h).status for h in (a, b, c, d)] == [
        Status.SUCCESS,
        Status.STOPPED,
        Status.FAILED,
        Status.PROCESSING,
    ]
    assert row(a).result == "A" and row(d).checkpoint == {"at": 3}


def test_heartbeats_extend_held_attempts_and_count_as_the_workers_liveness(worker: Api) -> None:
    taskflow.enqueue_many([{"task_type": T, "timeout": 100}] * 2)
    a, b = hold(worker)
    Task.objects.update(lease_expires_at=timezone.now())
    WorkerProcess.objects.update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    remote.forget_beats()  # five minutes later for the server too: its last beat of the worker is long past
    items = [fence(a), fence(b, lease=b["lease"] - 1)]
    status, body = worker.post("/api/tasks/heartbeat/", {"items": items})
    assert status == 200
    assert [(r["outcome"], r.get("error")) for r in body["results"]] == [("applied", None), ("refused", "forbidden")]
    assert row(a).lease_expires_at > timezone.now() + timedelta(seconds=90)
    assert row(b).lease_expires_at < timezone.now()
    beat = WorkerProcess.objects.get(worker_id=worker.worker_id).heartbeat_at
    assert beat > timezone.now() - timedelta(seconds=30)
    assert rescue.rescue_dead_workers() == 0


def test_a_remote_worker_that_stops_calling_is_rescued_like_a_local_one(worker: Api) -> None:
    taskflow.enqueue(T, max_retries=3)
    [held] = hold(worker)
    WorkerProcess.objects.update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert rescue.rescue_dead_workers() == 1
    assert row(held).status == Status.PENDING
    assert report(worker, held, status="success", result=1)[0] == 409


def test_release_hands_unstarted_tasks_back_without_using_an_attempt(worker: Api) -> None:
    taskflow.enqueue_many([{"task_type": T}] * 2)
    a, b = hold(worker)
    items = [fence(a), fence(b)] * 2
    status, body = worker.post("/api/tasks/release/", {"items": items})
    assert status == 200
    assert [r["outcome"] for r in body["results"]] == ["applied", "applied", "refused", "refused"]
    for h in (a, b):
        task = row(h)
        assert (task.status, task.attempts, task.worker_id) == (Status.PENDING, 0, "")
    assert len(hold(worker)) == 2


@pytest.mark.parametrize("url", ["/api/tasks/set/", "/api/tasks/heartbeat/", "/api/tasks/release/"])
@pytest.mark.parametrize(
    "body",
    [
        {},
        {"items": "x"},
        {"items": [{"task_id": "1"}] * 1001},
        {"items": [], "extra": 1},
        [],
    ],
)
def test_malformed_batches_are_400s(worker: Api, url: str, body: object) -> None:
    status, answer = worker.post(url, body)
    assert (status, answer["error"]) == (400, "invalid"), answer


@pytest.mark.parametrize("url", ["/api/tasks/set/", "/api/tasks/heartbeat/", "/api/tasks/release/"])
@pytest.mark.parametrize(
    "item", [{"task_id": 5, "lease": 1}, {"task_id": "5"}, {"task_id": "x", "lease": 1}, {"task_id": "5", "lease": "1"}]
)
def test_batches_refuse_items_without_a_well_formed_task_id_and_lease_with_400(
    worker: Api, url: str, item: dict
) -> None:
    status, answer = worker.post(url, {"items": [item]})
    assert (status, answer["error"]) == (400, "invalid") and "items[0]" in " ".join(answer["fields"]), answer


def test_a_heartbeat_answers_each_new_deadline() -> None:
    worker = registered(api_as("worker"))
    taskflow.enqueue(T, timeout=120)
    [held] = hold(worker)
    status, body = worker.post("/api/tasks/heartbeat/", {"items": [fence(held)]})
    assert status == 200 and "handed_back" not in body
    [result] = body["results"]
    assert result["lease_expires_at"] == HeldTaskSerializer(row(held)).data["lease_expires_at"]
    assert result["lease_expires_at"] > held["lease_expires_at"]


def test_a_liveness_beat_names_the_worker_and_hands_back_what_it_does_not_know_it_holds(worker: Api) -> None:
    taskflow.enqueue_many([{"task_type": T}] * 3)
    known, lost = hold(worker, limit=1), hold(worker, limit=2)  # the second hold's answer "never arrived"
    WorkerProcess.objects.all().delete()
    listed = [fence(h) for h in known]
    status, body = worker.post("/api/tasks/heartbeat/", {"beat": True, "items": listed})
    assert status == 200 and body["handed_back"] == 0  # claimed just now: perhaps still on its way
    assert WorkerProcess.objects.filter(worker_id=worker.worker_id).exists()
    Task.objects.update(started_at=timezone.now() - timedelta(seconds=10))
    status, body = worker.post("/api/tasks/heartbeat/", {"beat": True, "items": listed})
    assert status == 200 and body["handed_back"] == 2 and body["results"][0]["outcome"] == "applied"
    assert [row(h).status for h in lost] == [Status.PENDING, Status.PENDING]
    assert [row(h).attempts for h in lost] == [0, 0]
    assert row(known[0]).status == Status.PROCESSING
    # An idle worker beats with no items; another worker's attempts are never touched.
    other = registered(Api(worker.user), host="other-host")
    status, body = other.post("/api/tasks/heartbeat/", {"beat": True, "items": []})
    assert (status, body) == (200, {"results": [], "handed_back": 0})
    assert row(known[0]).status == Status.PROCESSING
    status, body = worker.post("/api/tasks/heartbeat/", {"worker_id": other.worker_id, "items": []})
    assert status == 400 and "worker_id" in body["fields"]


def test_a_workers_liveness_beat_checks_its_leases_and_extends_no_deadline(worker: Api) -> None:
    """With `beat` a heartbeat is the worker's beat: it answers which leases hold and writes no deadline."""
    taskflow.enqueue(T, {}, timeout=60)
    [held] = hold(worker)
    before = row(held).lease_expires_at
    status, body = worker.post("/api/tasks/heartbeat/", {"beat": True, "items": [fence(held)]})
    assert status == 200 and body["results"][0]["outcome"] == "applied", body
    assert row(held).lease_expires_at == before
    taskflow.terminate([int(held["task_id"])], by="ops")
    status, body = worker.post("/api/tasks/heartbeat/", {"beat": True, "items": [fence(held)]})
    assert body["results"][0] == {"task_id": held["task_id"], "outcome": "refused", "error": "lease_lost"}
