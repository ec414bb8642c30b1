"""A handler's progress (engine/progress.py, ctx.progress): checked, throttled, fenced by the attempt's lease,
written before the report, gone for a new attempt; the API's field and the remote worker's heartbeat."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.tasks import task
from django.test.utils import CaptureQueriesContext

import taskflow
from taskflow.engine import progress as progress_rules
from taskflow.engine import remote, rescue
from taskflow.engine.attempts import DatabaseChannel, Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.progress import Progress, ProgressThrottle, progress_of, shown
from taskflow.exceptions import InvalidTask, LeaseLost
from taskflow.models import Status, Task
from taskflow.runtime.context import TaskContext
from tests.apiclients import Api, api_as
from tests.remote_support import register_worker

pytestmark = pytest.mark.django_db
T = "test.progress"


def claim_one(task_type: str = T) -> Any:
    [attempt] = claim_batch(configs.get(task_type), 1, "host-p:1:w")
    return attempt


def stored(task_id: int) -> dict[str, Any] | None:
    task = Task.objects.get(pk=task_id)
    return shown(task.progress, task.lease_token)


# -- the rules ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "total", "message", "says"),
    [
        (5, 3, "", "must not exceed total"),
        (-1, 3, "", "from 0"),
        (1, float("inf"), "", "from 0"),
        (float("nan"), 3, "", "from 0"),
        ("1", 3, "", "must be a number"),
        (True, 3, "", "must be a number"),
        (1, 2**53 + 1, "", "from 0"),
        (1, 3, "x" * 201, "at most 200 characters"),
        (1, 3, None, "must be a string"),
    ],
)
def test_malformed_progress_is_refused_with_what_is_wrong(done: Any, total: Any, message: Any, says: str) -> None:
    with pytest.raises(InvalidTask, match=says):
        progress_of(done, total, message)


def test_the_throttle_passes_one_value_per_interval_and_keeps_the_latest() -> None:
    now = [100.0]
    throttle = ProgressThrottle(interval=1.0, clock=lambda: now[0])
    assert throttle.offer(1, 10) == Progress(1, 10)  # the first report is written at once
    assert throttle.offer(2, 10) is None
    now[0] += 0.5
    assert throttle.offer(3, 10, "third") is None
    assert throttle.pending == Progress(3, 10, "third")  # the latest, not the first held back
    now[0] += 0.6
    assert throttle.offer(4, 10) == Progress(4, 10) and throttle.pending is None
    assert throttle.take() is None
    with pytest.raises(InvalidTask, match="must not exceed total"):
        throttle.offer(5, 4)  # checked even when no write is due


# -- the local worker's context ----------------------------------------------------------------------------


class CountingChannel(DatabaseChannel):
    writes = 0

    def heartbeat(self, checkpoint: Any = ..., progress: Progress | None = None) -> Any:
        self.writes += 1
        return super().heartbeat(checkpoint, progress)


def test_a_hot_loop_writes_a_few_rows_and_its_last_value_before_the_report() -> None:
    task = taskflow.enqueue(T)
    attempt = claim_one()
    channel = CountingChannel(attempt)
    ctx = TaskContext(attempt, channel)

    def handler(ctx: TaskContext) -> str:
        for i in range(1, 200_001):
            ctx.progress(i, 200_000, "rows")
        return "done"

    with CaptureQueriesContext(connection) as queries:
        assert ctx.run(handler) == "done"
    # One write at the first call, one a second while it runs (none on a fast machine), and the last value.
    assert 2 <= channel.writes <= 2 + 10 and len(queries) == channel.writes
    last = stored(task.pk)
    assert (last["done"], last["total"], last["message"], last["percent"]) == (200_000, 200_000, "rows", 100.0)


def test_the_last_value_is_written_when_the_handler_raises_too() -> None:
    task = taskflow.enqueue(T)
    ctx = TaskContext(claim_one())

    def handler(ctx: TaskContext) -> None:
        ctx.progress(1, 4, "first")
        ctx.progress(3, 4, "third")  # held back by the throttle
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        ctx.run(handler)
    assert stored(task.pk)["message"] == "third"


def test_a_heartbeat_or_checkpoint_carries_the_held_back_value() -> None:
    task = taskflow.enqueue(T)
    ctx = TaskContext(claim_one())
    ctx.progress(1, 4)
    ctx.progress(2, 4)
    ctx.save_checkpoint({"at": 2})
    assert stored(task.pk)["done"] == 2
    ctx.progress(3, 4)
    ctx.heartbeat()
    assert stored(task.pk)["done"] == 3


def test_progress_is_fenced_by_the_attempts_lease() -> None:
    task = taskflow.enqueue(T)
    attempt = claim_one()
    ctx = TaskContext(attempt)
    ctx.progress(1, 10, "mine")
    before = Task.objects.get(pk=task.pk).progress
    # Taken away (rescued: its deadline passed) and claimed again by another attempt.
    Task.objects.filter(pk=task.pk).update(lease_expires_at=attempt.claimed_at)
    rescue.rescue_expired_attempts()
    Task.objects.filter(pk=task.pk).update(run_after=attempt.claimed_at, order_time=attempt.claimed_at)
    again = claim_one()
    assert again.lease_token != attempt.lease_token
    ctx._progress = ProgressThrottle()  # due at once
    with pytest.raises(LeaseLost):
        ctx.progress(9, 10, "a zombie's")
    assert Task.objects.get(pk=task.pk).progress == before  # nothing written
    ctx.progress(9, 10, "a zombie's")  # held back: the flush finds the lease lost and says nothing
    ctx.flush_progress()
    assert Task.objects.get(pk=task.pk).progress == before


def test_a_new_attempt_starts_with_no_progress_and_the_api_shows_each_attempts() -> None:
    task = taskflow.enqueue(T, max_retries=3)
    viewer = api_as("producer")
    ctx = TaskContext(first := claim_one())
    ctx.progress(40, 100, "page 40")
    status, body = viewer.get(f"/api/tasks/{task.pk}/")
    assert status == 200
    assert {k: body["progress"][k] for k in ("done", "total", "message", "percent")} == {
        "done": 40,
        "total": 100,
        "message": "page 40",
        "percent": 40.0,
    }
    finish_attempts([Report(first, Outcome.ERROR, error="flaky")])  # retried
    assert viewer.get(f"/api/tasks/{task.pk}/")[1]["progress"]["done"] == 40  # the last attempt's, while it waits
    Task.objects.filter(pk=task.pk).update(run_after=first.claimed_at, order_time=first.claimed_at)
    second = claim_one()
    assert second.attempt == 2
    assert viewer.get(f"/api/tasks/{task.pk}/")[1]["progress"] is None
    TaskContext(second).progress(1, 3)
    assert viewer.get(f"/api/tasks/{task.pk}/")[1]["progress"]["percent"] == 33.3


@task(takes_context=True)
def counts_with_progress(context: Any, n: int) -> int:
    for i in range(1, n + 1):
        context.progress(i, n, f"item {i}")
    return n


def test_a_django_task_reports_progress_through_its_context() -> None:
    from taskflow.runtime.django_tasks import run_django_task

    result = counts_with_progress.enqueue(5)
    task_type = Task.objects.get(pk=int(result.id)).task_type
    ctx = TaskContext(claim_one(task_type))
    assert ctx.run(run_django_task) == 5
    assert (stored(int(result.id))["done"], stored(int(result.id))["message"]) == (5, "item 5")


# -- the remote worker's heartbeat -------------------------------------------------------------------------


@pytest.fixture
def worker() -> Api:
    api = api_as("worker")
    register_worker(api, host="remote-host")
    return api


def hold(api: Api) -> dict:
    status, body = api.post("/api/tasks/hold/", {"task_types": [T], "limit": 1})
    assert status == 200, body
    return body["tasks"][0]


def fence(held: dict, **more: object) -> dict:
    return {"task_id": held["task_id"], "lease": held["lease"], "attempt_key": held["attempt_key"], **more}


def test_a_remote_heartbeat_or_checkpoint_saves_progress(worker: Api) -> None:
    task = taskflow.enqueue(T)
    held = hold(worker)
    status, body = worker.post("/api/tasks/heartbeat/", {"items": [fence(held, progress={"done": 2, "total": 8})]})
    assert status == 200 and body["results"][0]["outcome"] == "applied", body
    assert stored(task.pk)["percent"] == 25.0 and stored(task.pk)["message"] == ""
    progress = {"done": 6.5, "total": 8, "message": "almost"}
    body = {"lease": held["lease"], "attempt_key": held["attempt_key"], "checkpoint": {"n": 6}, "progress": progress}
    status, body = worker.post(f"/api/tasks/{task.pk}/set/", body)
    assert status == 200 and body["progress"]["message"] == "almost", body
    assert Task.objects.get(pk=task.pk).checkpoint == {"n": 6}


@pytest.mark.parametrize(
    ("progress", "field", "says"),
    [
        ({"done": 9, "total": 8}, "items[0].progress.done", "must not exceed total (9 > 8)"),
        ({"done": -1, "total": 8}, "items[0].progress.done", "greater than or equal to 0"),
        ({"done": "1", "total": 8}, "items[0].progress.done", "valid number"),
        ({"done": 1}, "items[0].progress.total", "required"),
        ({"done": 1, "total": 2, "message": "m" * 201}, "items[0].progress.message", "200"),
        ({"done": 1, "total": 2, "extra": 1}, "items[0].progress.extra", "unknown field"),
        ([1, 2], "items[0].progress", ""),
    ],
)
def test_bad_remote_progress_is_a_precise_400_and_writes_nothing(
    worker: Api, progress: Any, field: str, says: str
) -> None:
    task = taskflow.enqueue(T)
    held = hold(worker)
    before = Task.objects.get(pk=task.pk)
    status, body = worker.post("/api/tasks/heartbeat/", {"items": [fence(held, progress=progress)]})
    assert status == 400, body
    assert field in body["fields"] and says in " ".join(body["fields"][field]), body
    after = Task.objects.get(pk=task.pk)
    assert (after.progress, after.lease_expires_at) == (before.progress, before.lease_expires_at)


def test_a_liveness_beat_carries_no_progress(worker: Api) -> None:
    taskflow.enqueue(T)
    held = hold(worker)
    status, body = worker.post(
        "/api/tasks/heartbeat/", {"beat": True, "items": [fence(held, progress={"done": 1, "total": 2})]}
    )
    assert status == 400 and "beat" in body["fields"], body


def test_the_remote_channel_sends_progress_with_its_heartbeat() -> None:
    """HttpChannel puts the progress into the heartbeat item and the checkpoint body it sends."""
    from taskflow.runtime.remote import HttpChannel

    sent: list[tuple[str, Any]] = []

    class Client:
        def batch(self, path: str, items: list[dict]) -> list[dict]:
            sent.append((path, items))
            return [{"outcome": "applied", "lease_expires_at": "2030-01-01T00:00:00Z"}]

        def set_task(self, task_id: str, body: dict) -> dict:
            sent.append((task_id, body))
            return {"lease_expires_at": "2030-01-01T00:00:00Z"}

    class Attempt:
        id, attempt, lease, attempt_key = 7, 1, 3, "k" * 64
        fence = {"task_id": "7", "lease": 3, "attempt_key": "k" * 64}

        def extended(self, answer: dict) -> str:
            return answer["lease_expires_at"]

    channel = HttpChannel(Client(), Attempt())  # type: ignore[arg-type]
    channel.heartbeat(progress=Progress(1, 2, "half"))
    channel.heartbeat({"c": 1}, progress=Progress(2, 2))
    channel.heartbeat()
    assert sent[0] == ("tasks/heartbeat/", [{**Attempt.fence, "progress": {"done": 1, "total": 2, "message": "half"}}])
    assert sent[1][1]["progress"] == {"done": 2, "total": 2, "message": ""} and sent[1][1]["checkpoint"] == {"c": 1}
    assert sent[2] == ("tasks/heartbeat/", [Attempt.fence])


def test_the_remote_engine_saves_progress_in_the_heartbeats_update() -> None:
    w = "host-r:7:abc"
    task = taskflow.enqueue(T)
    [attempt] = remote.hold([T], 1, w)
    held = remote.Held(attempt.id, attempt.lease_token, remote.attempt_key(attempt.id, attempt.lease_token, w))
    stale = remote.Held(attempt.id, attempt.lease_token + 5, remote.attempt_key(attempt.id, attempt.lease_token + 5, w))
    out = remote.extend(w, [(held, ...), (stale, ...)], [Progress(3, 4, "x"), Progress(4, 4)])
    assert out[1] == remote.Refused.LEASE_LOST
    assert stored(task.pk)["done"] == 3
    assert progress_rules.MAX_MESSAGE == 200
    assert Task.objects.get(pk=task.pk).status == Status.PROCESSING
