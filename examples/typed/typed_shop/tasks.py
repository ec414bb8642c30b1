"""Handlers, enqueueing and operations with the types a checker should see."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TypedDict

import taskflow
from taskflow import OperationResult, TaskContext
from taskflow.models import Task


class Receipt(TypedDict):
    order: int
    sent_to: str


@taskflow.handler("shop.receipt")
def send_receipt(ctx: TaskContext) -> Receipt:
    order: int = ctx.payload["order"]
    attempt: int = ctx.attempt
    if attempt > ctx.max_retries:
        ctx.fail("out of attempts")
    deadline: datetime = ctx.deadline
    if ctx.stop_requested or deadline < datetime.now(deadline.tzinfo):
        ctx.snooze(30, reason="later")
    if ctx.stage == "":
        ctx.next_stage("send", context={"order": order})
    ctx.save_checkpoint({"sent": True})
    return {"order": order, "sent_to": f"customer-{order}@example.com"}


def direct_call(ctx: TaskContext) -> str:
    # The decorator keeps the function's own type: its result is a Receipt, not Any.
    return send_receipt(ctx)["sent_to"]


def checkout(order: int) -> Task:
    task = taskflow.enqueue(
        "shop.receipt", {"order": order}, key=f"order-{order}", priority=10, run_after=timedelta(minutes=5)
    )
    outcome: str = task.enqueue_outcome
    task_id: int = task.id
    status: str = task.status
    print(outcome, task_id, status)
    return task


def bulk(orders: list[int]) -> list[int]:
    tasks = taskflow.enqueue_many([{"task_type": "shop.receipt", "payload": {"order": n}} for n in orders])
    return [task.id for task in tasks]


def steer(task_id: int) -> int:
    task: Task = taskflow.get_task(task_id)
    results: list[OperationResult] = [
        taskflow.terminate([task], by="ops-bot", reason="duplicate"),
        taskflow.retry_now([task_id], by="ops-bot"),
        taskflow.reschedule(Task.objects.filter(task_type="shop.receipt"), run_after=60.0, by="ops-bot"),
        taskflow.set_priority([task], priority=5, by="ops-bot"),
        taskflow.set_max_retries([task], max_retries=2, by="ops-bot", dry_run=True),
    ]
    return sum(result.changed for result in results)


taskflow.periodic("nightly-receipts", task_type="shop.receipt", cron="0 3 * * *", payload={"order": 0})
