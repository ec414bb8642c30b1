"""The registry of live workers: each worker process beats its WorkerProcess row on its own.

Kept apart from any task's deadline: a worker that is alive but running a stuck handler still
beats, and a dead worker stops beating however long its tasks were allowed to run. Beats are
written and judged by the database's clock, so a worker host whose clock is off cannot look dead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db.models.expressions import RawSQL

from ..conf import get_settings
from ..models import Status, Task, WorkerProcess
from . import sql

log = logging.getLogger("taskflow.watch")


def touch(worker_id: str) -> bool:
    """Record that `worker_id` is alive now, if it is registered; False if it has no liveness row."""
    return bool(WorkerProcess.objects.filter(worker_id=worker_id).update(heartbeat_at=sql.database_now()))


def beat(worker_id: str, host: str, task_types: list[str], concurrency: int, pid: int | None = None) -> None:
    """Record that `worker_id` is alive now (registering it on its first beat)."""
    if not touch(worker_id):
        WorkerProcess.objects.create(
            worker_id=worker_id,
            host=host,
            pid=os.getpid() if pid is None else pid,
            task_types=task_types,
            concurrency=concurrency,
            started_at=sql.database_now(),
            heartbeat_at=sql.database_now(),
        )


def liveness_cutoff() -> RawSQL:
    """The moment, by the database's clock, before which a worker's last beat means it is dead."""
    return sql.database_now(-get_settings().LIVENESS_TIMEOUT)


def alive() -> list[dict[str, Any]]:
    """The workers alive now, by the database's clock: worker_id, host, concurrency and task types of each."""
    rows = WorkerProcess.objects.filter(heartbeat_at__gte=liveness_cutoff()).order_by("host", "worker_id")
    return list(rows.values("worker_id", "host", "concurrency", "task_types"))


def forget(worker_id: str) -> None:
    """Remove a worker that stopped cleanly (nothing of it is left to rescue)."""
    WorkerProcess.objects.filter(worker_id=worker_id).delete()


def reap_dead_worker_rows(now: datetime | None = None, keep_going: Callable[[], bool] = lambda: True) -> int:
    """Delete liveness rows of dead workers once none of their attempts remains processing.

    Who is dead is decided by the database's clock; `now` is accepted as by every duty, unused.
    """
    dead = list(WorkerProcess.objects.filter(heartbeat_at__lt=liveness_cutoff()).values_list("worker_id", flat=True))
    if not dead or not keep_going():
        return 0
    busy = set(
        Task.objects.filter(status=Status.PROCESSING, worker_id__in=dead).values_list("worker_id", flat=True).distinct()
    )
    idle = [w for w in dead if w not in busy]
    # Guarded on the stale beat: a worker that beats again in between keeps its row.
    stale = WorkerProcess.objects.filter(worker_id__in=idle, heartbeat_at__lt=liveness_cutoff())
    count = stale.delete()[0] if idle else 0
    if count:
        log.info("removed %d dead worker row(s)", count)
    return count
