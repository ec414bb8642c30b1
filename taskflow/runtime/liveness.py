"""The worker's liveness thread: beats the worker's WorkerProcess row every HEARTBEAT_INTERVAL."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from django.db import DatabaseError

from ..conf import get_settings
from ..engine import workers
from . import connections


class LivenessBeat:
    """Beats the worker's row on a thread of its own, so a long handler never makes it look dead.

    The beat is a supervised loop: a database outage is waited out, but if the loop cannot go on
    `on_fatal` is called, because a worker that runs tasks without beating would have them rescued
    and run twice.
    """

    def __init__(
        self,
        worker_id: str,
        host: str,
        task_types: list[str],
        concurrency: int,
        *,
        on_fatal: Callable[[str], None],
        after_beat: Callable[[], None] | None = None,
    ) -> None:
        self.worker_id, self.host, self.task_types, self.concurrency = worker_id, host, task_types, concurrency
        self.after_beat = after_beat
        self.interval = get_settings().HEARTBEAT_INTERVAL
        self._stopped = threading.Event()
        self._loop = connections.supervised(
            "taskflow-liveness", self._beat_and_wait, on_fatal=on_fatal, stop=self._stopped
        )
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        workers.beat(self.worker_id, self.host, self.task_types, self.concurrency)

    def start(self) -> None:
        self._thread = self._loop.start_thread()

    def _beat_and_wait(self) -> None:
        connections.drop_unusable()
        self.beat()
        if self.after_beat is not None:
            self.after_beat()
        self._stopped.wait(self.interval)

    def halt(self) -> None:
        """Stop beating now (safe from any thread): the worker will look dead once LIVENESS_TIMEOUT passes."""
        self._stopped.set()

    def stop(self, *, forget: bool = True) -> None:
        """Stop beating and, for a clean stop, remove the worker's row (nothing of it is left to rescue)."""
        self.halt()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if forget:
            with contextlib.suppress(DatabaseError):
                workers.forget(self.worker_id)
