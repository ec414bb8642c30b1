"""The API over real HTTP: remote workers holding and reporting at the same time on a live server."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import requests
from rest_framework.authtoken.models import Token

import taskflow
from taskflow.models import Status, Task
from tests.apiclients import user_with

T = "api.live"
WORKERS = 4
TASKS = 300


@pytest.fixture
def worker_token(transactional_db) -> str:  # noqa: ANN001
    return Token.objects.create(user=user_with("remote", "hold_task")).key


def test_concurrent_remote_workers_each_get_distinct_tasks_and_every_task_ends_once(
    live_server,  # noqa: ANN001
    worker_token: str,
) -> None:
    taskflow.enqueue_many([{"task_type": T, "payload": {"n": n}} for n in range(TASKS)])
    held: Counter[str] = Counter()
    applied: Counter[str] = Counter()
    failures: list[BaseException] = []
    lock = threading.Lock()

    def work(number: int) -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {worker_token}"
        try:
            body = {"host": "live-host", "pid": number, "task_types": [T], "concurrency": 7}
            answer = session.post(f"{live_server.url}/api/workers/", json=body, timeout=60)
            answer.raise_for_status()
            session.headers["Taskflow-Worker-Id"] = answer.json()["worker_id"]
            session.headers["Taskflow-Worker-Key"] = answer.json()["worker_key"]
            while True:
                answer = session.post(
                    f"{live_server.url}/api/tasks/hold/", json={"task_types": [T], "limit": 7}, timeout=60
                )
                answer.raise_for_status()
                tasks = answer.json()["tasks"]
                if not tasks:
                    return
                items = [
                    {"task_id": t["task_id"], "lease": t["lease"], "attempt_key": t["attempt_key"]}
                    | {"status": "success", "result": t["payload"]["n"]}
                    for t in tasks
                ]
                # Each report sent twice: the second is a repeat the server must refuse.
                results = []
                for _ in range(2):
                    reply = session.post(f"{live_server.url}/api/tasks/set/", json={"items": items}, timeout=60)
                    reply.raise_for_status()
                    results += reply.json()["results"]
                with lock:
                    held.update(t["task_id"] for t in tasks)
                    applied.update(r["task_id"] for r in results if r["outcome"] == "applied")
        except BaseException as exc:  # reported by the test below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not failures, failures
    assert len(held) == TASKS and set(held.values()) == {1}
    assert len(applied) == TASKS and set(applied.values()) == {1}
    done = Task.objects.filter(task_type=T, status=Status.SUCCESS)
    assert done.count() == TASKS
    assert all(task.result == task.payload["n"] and len(task.schedule_log) == 1 for task in done)
