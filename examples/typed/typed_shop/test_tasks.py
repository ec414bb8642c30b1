"""taskflow.testing, typed: the helpers and their results as a checker sees them."""

from __future__ import annotations

import taskflow
from taskflow.models import Task
from taskflow.testing import Attempt, assert_enqueued, eager, run_tasks


def run_one() -> str:
    taskflow.enqueue("shop.receipt", {"order": 1})
    ran: list[Attempt] = run_tasks(["shop.receipt"])
    with eager():
        taskflow.enqueue("shop.receipt", {"order": 2})
    found: list[Task] = assert_enqueued("shop.receipt", payload={"order": 2})
    return f"{ran[0].outcome} {ran[0].task().status} {len(found)}"
