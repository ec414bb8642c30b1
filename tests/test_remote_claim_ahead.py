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
