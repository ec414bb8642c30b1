"""Worker liveness: each worker process heartbeats its WorkerProcess row on its own thread.

Kept apart from any task's deadline: a worker that is alive but running a stuck handler still
beats, and a dead worker stops beating however long its tasks were allowed to run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from django.db import DatabaseError, connection
from django.utils import timezone

from .conf import get_settings
from .models import WorkerProcess

log = logging.getLogger("taskflow.liveness")


class LivenessBeat(threading.Thread):
    def __init__(
        self, worker_id: str, host: str, task_types: list[str], concurrency: int, done: threading.Event
    ) -> None:
        super().__init__(name="taskflow-liveness", daemon=True)
        self.worker_id, self.host, self.task_types, self.concurrency = worker_id, host, task_types, concurrency
        self._done = done
        self._stopped = threading.Event()

    def beat(self) -> None:
        now = timezone.now()
        updated = WorkerProcess.objects.filter(worker_id=self.worker_id).update(heartbeat_at=now)
        if not updated:
            WorkerProcess.objects.create(
                worker_id=self.worker_id,
                host=self.host,
                pid=os.getpid(),
                task_types=self.task_types,
                concurrency=self.concurrency,
                started_at=now,
                heartbeat_at=now,
            )

    def run(self) -> None:
        interval = get_settings().HEARTBEAT_INTERVAL
        while not self._stopped.is_set():
            try:
                self.beat()
            except DatabaseError as exc:
                log.warning("liveness heartbeat failed: %s", exc)
                connection.close()
            self._stopped.wait(interval)
        with contextlib.suppress(DatabaseError):
            WorkerProcess.objects.filter(worker_id=self.worker_id).delete()
        connection.close()

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)
