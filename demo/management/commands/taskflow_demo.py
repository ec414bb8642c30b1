import signal
import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.db.models import Count

import taskflow
from taskflow.engine.registry import registered_types
from taskflow.management.commands.taskworker import non_negative_float, positive_int
from taskflow.models import Status, Task


def demo_requests(round_no: int, version: int) -> list[dict[str, Any]]:
    """One round of demo work: each demo type, a keyed/versioned task, a delayed one, a priority pair."""
    return [
        *({"task_type": "demo.noop", "payload": {"round": round_no, "n": n}} for n in range(3)),
        *({"task_type": "demo.resize_image", "payload": {"width": 320 * (n + 1)}} for n in range(3)),
        # Three documents, each re-sent with a newer version (a timestamp, so it still grows after a
        # restart): a newer version supersedes an older one that has not started yet.
        {
            "task_type": "demo.parse_document",
            "payload": {"pages": 2 + round_no % 4},
            "key": f"doc-{round_no % 3}",
            "version": version,
        },
        {"task_type": "demo.noop", "payload": {"delayed": True}, "run_after": 10},
        {"task_type": "demo.resize_image", "payload": {"width": 1920}, "priority": 50},
        {"task_type": "demo.resize_image", "payload": {"width": 64}, "priority": -50},
        {"task_type": "demo.notify", "payload": {"to": "ops@example.com" if round_no % 4 else ""}},
    ]


class Command(BaseCommand):
    help = "Keep demo tasks flowing: enqueue a round of demo tasks every few seconds until stopped."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--interval", type=non_negative_float, default=3.0, help="seconds between rounds")
        parser.add_argument("--rounds", type=positive_int, default=None, help="stop after this many rounds")

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        missing = {r["task_type"] for r in demo_requests(0, 0)} - set(registered_types())
        if missing:
            raise CommandError(f"no handler for {', '.join(sorted(missing))}: is the 'demo' app installed?")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
        signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
        round_no = 0
        while not stop.is_set() and (options["rounds"] is None or round_no < options["rounds"]):
            round_no += 1
            try:
                # One transaction per round: the tasks commit together, as they would with business data.
                with transaction.atomic():
                    tasks = taskflow.enqueue_many(demo_requests(round_no, version=time.time_ns() // 1_000_000))
            except taskflow.StaleVersion as exc:
                self.stderr.write(f"round {round_no} refused: {exc}")
                tasks = []
            by_status = (
                Task.objects.filter(task_type__startswith="demo.").values("status").annotate(n=Count("id")).order_by()
            )
            counts = {row["status"]: row["n"] for row in by_status}
            summary = ", ".join(f"{status} {counts[status]}" for status in Status.values if status in counts)
            self.stdout.write(f"round {round_no}: enqueued {len(tasks)} | demo tasks: {summary}")
            stop.wait(options["interval"])
