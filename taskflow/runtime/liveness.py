"""The worker's liveness thread: beats the worker's WorkerProcess row every HEARTBEAT_INTERVAL."""

from __future__ import annotations

import contextlib
import logging
import threading

from django.db import DatabaseError, connection

from ..conf import get_settings
from ..engine import workers

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
        workers.beat(self.worker_id, self.host, self.task_types, self.concurrency)

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
            workers.forget(self.worker_id)
        connection.close()

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5)
