"""One JSON nesting limit (MAX_JSON_DEPTH) for payloads, contexts, checkpoints and results, everywhere.

MariaDB's JSON_VALID check refuses 32 levels: before the limit, such a value made the API answer 503
"try again" (for ever), a remote checkpoint lose its lease, and an in-process enqueue raise
IntegrityError there, while SQLite and PostgreSQL stored it. Now every database refuses the same
values, before anything is written.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import taskflow
from taskflow.engine.attempts import heartbeat
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.validation import MAX_JSON_DEPTH, json_depth
from taskflow.exceptions import InvalidSchedule, InvalidTask
from taskflow.models import PeriodicTask, Status, Task, TaskKey
from taskflow.runtime.context import TaskContext
from taskflow.runtime.remote import HttpChannel, RemoteAttempt, RemoteWorker
from taskflow.runtime.remote_client import ApiClient
from tests.apiclients import Api, api_as

from .conftest import run_in_thread, wait_until
from .remote_support import api_token, register_worker

T = "test_nesting.deep"
MARIADB_REFUSES = 32


def arrays(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def objects(depth: int) -> Any:
    value: Any = [1, "x"]
    for i in range(depth - 1):
        value = {f"k{i}": value, "n": i, "s": "[[[{{{"}  # brackets in strings do not nest
    return value


TOO_DEEP = [arrays(MAX_JSON_DEPTH + 1), objects(MAX_JSON_DEPTH + 1), arrays(MARIADB_REFUSES), objects(40)]
DEEPEST_ALLOWED = [arrays(MAX_JSON_DEPTH), objects(MAX_JSON_DEPTH)]


@taskflow.handler(T)
def deep(ctx: Any) -> Any:
    """Hands back a value nested `depth` levels where the payload says: result, context or checkpoint."""
    what, depth = ctx.payload["what"], ctx.payload.get("depth", MARIADB_REFUSES)
    if what == "result":
        return arrays(depth)
    if what == "context" and ctx.stage != "next":
        ctx.next_stage("next", context=arrays(depth))
    if what == "checkpoint":
        try:
            ctx.save_checkpoint(arrays(depth))
        except InvalidTask as exc:
            ctx.save_checkpoint({"refused": str(exc)})  # the attempt still holds its lease
            return {"refused": True}
        return {"refused": False}
    return {"ok": True}


# -- counting ---------------------------------------------------------------------------------------


def test_depth_counts_nested_arrays_and_objects_the_outermost_being_one() -> None:
    assert [json_depth(v) for v in (1, "x", None, [], {}, [1, "a"], {"a": [1]}, [[], [[{}]]])] == [
        0, 0, 0, 1, 1, 1, 2, 4,
    ]  # fmt: skip
    assert json_depth(arrays(MAX_JSON_DEPTH)) == json_depth(objects(MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
    assert json_depth(arrays(1000)) == MAX_JSON_DEPTH + 1  # counted no further than it matters


# -- in process ---------------------------------------------------------------------------------------


def nothing_written() -> bool:
    return not Task.objects.exists() and not TaskKey.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("value", TOO_DEEP, ids=["arrays25", "objects25", "arrays32", "objects40"])
def test_enqueue_refuses_a_payload_or_context_nested_too_deep_and_writes_nothing(value: Any) -> None:
    with pytest.raises(InvalidTask, match=r"^payload nests arrays and objects more than 24 levels"):
        taskflow.enqueue("test.noop", value, key="k")
    with pytest.raises(InvalidTask, match=r"^context nests"):
        taskflow.enqueue("test.noop", {}, context=value, key="k")
    with pytest.raises(InvalidTask, match=r"^payload nests"):
        taskflow.enqueue_many([{"task_type": "test.noop"}, {"task_type": "test.noop", "payload": value}])
    assert nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("value", DEEPEST_ALLOWED, ids=["arrays24", "objects24"])
def test_the_deepest_allowed_value_is_stored_and_read_back_on_every_database(value: Any) -> None:
    task = taskflow.enqueue("test.noop", value, context=value)
    assert Task.objects.values_list("payload", "context").get(pk=task.pk) == (value, value)


@pytest.mark.django_db
def test_a_checkpoint_nested_too_deep_is_refused_and_the_attempt_keeps_its_lease() -> None:
    taskflow.enqueue(T, {"what": "checkpoint"})
    [held] = claim_batch(configs.get(T), 1, "w1")
    before = Task.objects.filter(pk=held.id).values().get()
    for value in TOO_DEEP:
        with pytest.raises(InvalidTask, match=r"^checkpoint nests"):
            heartbeat(held, checkpoint=value)
        with pytest.raises(InvalidTask, match=r"^checkpoint nests"):
            TaskContext(held).save_checkpoint(value)
    assert Task.objects.filter(pk=held.id).values().get() == before
    heartbeat(held, checkpoint=arrays(MAX_JSON_DEPTH))  # still its attempt
    assert Task.objects.get(pk=held.id).checkpoint == arrays(MAX_JSON_DEPTH)


@pytest.mark.django_db
def test_a_schedule_payload_nested_too_deep_is_refused() -> None:
    from taskflow.engine.periodic import create_schedule

    with pytest.raises((InvalidSchedule, InvalidTask), match="payload nests"):
        create_schedule(PeriodicTask(name="deep", task_type="test.noop", every=60, payload=arrays(MARIADB_REFUSES)))
    assert not PeriodicTask.objects.exists()


def final(*tasks: Task) -> list[Task]:
    ids = [t.pk for t in tasks]
    done = (Status.SUCCESS, Status.FAILED, Status.STOPPED)
    wait_until(lambda: Task.objects.filter(pk__in=ids, status__in=done).count() == len(ids), timeout=30)
    rows = Task.objects.in_bulk(ids)
    return [rows[i] for i in ids]


def test_a_local_handler_nesting_its_result_context_or_checkpoint_too_deep_fails_its_task_alone(
    start_worker,  # noqa: ANN001
) -> None:
    result = taskflow.enqueue(T, {"what": "result"}, max_retries=3)
    context = taskflow.enqueue(T, {"what": "context"}, max_retries=3)
    checkpoint = taskflow.enqueue(T, {"what": "checkpoint"})
    fine = [taskflow.enqueue(T, {"what": what, "depth": MAX_JSON_DEPTH}) for what in ("result", "context")]
    start_worker([T], concurrency=5)
    result, context, checkpoint, *fine = final(result, context, checkpoint, *fine)
    for row in (result, context):
        assert (row.status, row.attempts) == (Status.FAILED, 1), row.status_msg  # not retried: it would do the same
        assert "nests arrays and objects more than 24 levels" in row.status_msg
    assert "result" in result.status_msg and "context" in context.status_msg
    assert (checkpoint.status, checkpoint.result) == (Status.SUCCESS, {"refused": True})
    assert checkpoint.checkpoint["refused"].startswith("checkpoint nests")
    assert [row.status for row in fine] == [Status.SUCCESS, Status.SUCCESS]
    assert fine[0].result == arrays(MAX_JSON_DEPTH) and fine[1].stage == "next"


# -- over the API ---------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("value", [arrays(MAX_JSON_DEPTH + 1), arrays(MARIADB_REFUSES), objects(40)])
def test_the_api_answers_400_for_a_value_nested_too_deep_and_writes_nothing(value: Any) -> None:
    producer = api_as("producer")
    for body, field in (
        ({"task_type": "api.deep", "payload": value}, "payload"),
        ({"task_type": "api.deep", "context": value}, "context"),
    ):
        status, answer = producer.post("/api/tasks/", body)
        assert (status, answer["error"], list(answer["fields"])) == (400, "invalid", [field]), answer
        status, answer = producer.post("/api/tasks/bulk/", {"tasks": [{"task_type": "api.deep"}, body]})
        assert (status, list(answer["fields"])) == (400, [f"tasks[1].{field}"]), answer
    assert not Task.objects.exists()


def lease_of(held: dict[str, Any]) -> dict[str, Any]:
    return {"lease": held["lease"], "attempt_key": held["attempt_key"]}


def hold(worker: Api, count: int) -> list[dict[str, Any]]:
    register_worker(worker, task_types=("api.deep",))
    status, body = worker.post("/api/tasks/hold/", {"task_types": ["api.deep"], "limit": count})
    assert status == 200 and len(body["tasks"]) == count, body
    return body["tasks"]


@pytest.mark.django_db
def test_a_worker_report_nested_too_deep_is_400_and_the_attempt_stays_held() -> None:
    taskflow.enqueue_many([{"task_type": "api.deep"} for _ in range(2)])
    worker = api_as("worker")
    held, other = hold(worker, 2)
    before = Task.objects.filter(pk=int(held["task_id"])).values().get()
    value = arrays(MARIADB_REFUSES)
    for body, field in (
        ({"status": "success", "result": value}, "result"),
        ({"stage": "next", "context": value}, "context"),
        ({"checkpoint": value}, "checkpoint"),
    ):
        status, answer = worker.post(f"/api/tasks/{held['task_id']}/set/", {**lease_of(held), **body})
        assert (status, answer["error"], list(answer["fields"])) == (400, "invalid", [field]), answer
    assert Task.objects.filter(pk=int(held["task_id"])).values().get() == before

    # In a batch the deep item is refused alone; the other is applied.
    items = [
        {"task_id": held["task_id"], **lease_of(held), "checkpoint": value},
        {"task_id": other["task_id"], **lease_of(other), "status": "success", "result": arrays(MAX_JSON_DEPTH)},
    ]
    status, answer = worker.post("/api/tasks/set/", {"items": items})
    assert status == 200
    assert [r["outcome"] for r in answer["results"]] == ["refused", "applied"]
    assert answer["results"][0]["error"] == "invalid" and "nests" in answer["results"][0]["detail"]
    assert Task.objects.filter(pk=int(held["task_id"])).values().get() == before
    assert Task.objects.get(pk=int(other["task_id"])).result == arrays(MAX_JSON_DEPTH)
    # Still this worker's attempt: its report is taken.
    success = {**lease_of(held), "status": "success", "result": 1}
    status, _ = worker.post(f"/api/tasks/{held['task_id']}/set/", success)
    assert status == 200 and Task.objects.get(pk=int(held["task_id"])).status == Status.SUCCESS


# -- the remote worker ------------------------------------------------------------------------------------


@pytest.fixture
def remote_token(transactional_db) -> str:  # noqa: ANN001
    return api_token("remote-deep", "hold_task")


def test_a_remote_checkpoint_nested_too_deep_raises_invalid_task_and_keeps_the_lease(
    live_server, remote_token: str  # noqa: ANN001
) -> None:
    task = taskflow.enqueue(T, {"what": "checkpoint"}, timeout=60)
    client = ApiClient(live_server.url + "/api/", remote_token, timeout=5)
    client.register("deep-host", 1, [T], 1)
    [held], clock = client.hold([T], 1)
    attempt = RemoteAttempt.from_json(held, time.monotonic(), clock)
    channel = HttpChannel(client, attempt)
    before = Task.objects.filter(pk=task.pk).values().get()
    with pytest.raises(InvalidTask, match="checkpoint nests"):
        channel.heartbeat(arrays(MARIADB_REFUSES))  # was: 503s until the lease expired, then LeaseLost
    assert Task.objects.filter(pk=task.pk).values().get() == before
    assert not attempt.stop_requested.is_set()
    channel.heartbeat({"still": "held"})
    assert Task.objects.get(pk=task.pk).checkpoint == {"still": "held"}


def test_a_remote_handler_nesting_its_result_or_checkpoint_too_deep_fails_its_task_alone(
    live_server, remote_token: str, run_log  # noqa: ANN001
) -> None:
    result = taskflow.enqueue(T, {"what": "result"}, max_retries=3)
    context = taskflow.enqueue(T, {"what": "context"}, max_retries=3)
    checkpoint = taskflow.enqueue(T, {"what": "checkpoint"})
    fine = taskflow.enqueue(T, {"what": "result", "depth": MAX_JSON_DEPTH})
    worker = RemoteWorker(
        ApiClient(live_server.url + "/api/", remote_token, timeout=5),
        [T],
        concurrency=4,
        poll_interval=0.1,
        beat_interval=0.3,
        grace=5.0,
        flush_timeout=10.0,
    )
    thread, raised = run_in_thread(worker)
    try:
        result, context, checkpoint, fine = final(result, context, checkpoint, fine)
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive() and raised == []
    for row in (result, context):
        assert (row.status, row.attempts) == (Status.FAILED, 1), row.status_msg
        assert "nests arrays and objects" in row.status_msg
    assert (checkpoint.status, checkpoint.result) == (Status.SUCCESS, {"refused": True})
    assert "checkpoint nests" in checkpoint.checkpoint["refused"]
    assert (fine.status, fine.result) == (Status.SUCCESS, arrays(MAX_JSON_DEPTH))
