"""taskwatch: runs the governance duties every WATCH_INTERVAL while this process holds the leader lease.

The duties themselves are engine functions (rescue, expiry, the worker registry, the limiter);
each is small, idempotent, returns how many tasks (or rows) it changed and logs one line when it
changed any. The watcher only decides when they run and stops them when leadership is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime

from django.db import DatabaseError, close_old_connections

from ..conf import get_settings
from ..engine import limiter, periodic
from ..engine.dependencies import repair_waiting
from ..engine.expiry import expire_successes, fail_stale_pending, purge_finished
from ..engine.rescue import free_lingering_slots, rescue_dead_workers, rescue_expired_attempts
from ..engine.rolling import roll_when_due
from ..engine.stats import refresh as refresh_stats
from ..engine.workers import reap_dead_worker_rows
from . import connections
from .leadership import Leadership

log = logging.getLogger("taskflow.watch")

KeepGoing = Callable[[], bool]
Duty = Callable[[datetime | None, KeepGoing], int]

# Order matters: rescue before reaping worker rows, and dead workers before deadlines so the log
# says the more useful reason.
DUTIES: tuple[tuple[str, Duty], ...] = (
    ("fire_periodic_tasks", periodic.fire_periodic_tasks),
    ("rescue_dead_workers", rescue_dead_workers),
    ("rescue_expired_attempts", rescue_expired_attempts),
    ("free_lingering_slots", free_lingering_slots),
    ("repair_waiting", repair_waiting),
    ("fail_stale_pending", fail_stale_pending),
    ("expire_successes", expire_successes),
    ("purge_finished", purge_finished),
    ("roll_tables", roll_when_due),
    ("reap_dead_worker_rows", reap_dead_worker_rows),
    ("refresh_stats", refresh_stats),
)


def reconcile_counters() -> int:
    """Make the limiter's Redis slot sets hold exactly the processing attempts; returns how many sets it checked.

    The limiter logs the corrections it makes; without Redis there is nothing to reconcile.
    """
    return len(limiter.reconcile_counters())


class Watcher:
    """Runs the duties every `interval` seconds while this process holds the leader lease."""

    def __init__(
        self,
        *,
        interval: float | None = None,
        leadership: Leadership | None = None,
        duties: Iterable[tuple[str, Duty]] = DUTIES,
    ) -> None:
        settings = get_settings()
        self.interval = settings.WATCH_INTERVAL if interval is None else interval
        if self.interval <= 0:
            raise ValueError("the watch interval must be positive")
        self.leadership = leadership or Leadership()
        self.duties = list(duties)
        self.reconcile_interval = settings.RECONCILE_INTERVAL
        self._next_reconcile = 0.0
        self._stop = threading.Event()

    def request_stop(self) -> None:
        """Finish the current duty and stop (from any thread; not from a signal handler: see stop_signals)."""
        self._stop.set()

    def keep_going(self) -> bool:
        """Whether a duty may go on with its next batch."""
        return self.leadership.active and not self._stop.is_set()

    def run(self) -> None:
        """Pass every `interval` until stopped, renewing the lease in between; resign on the way out."""
        # taskwatch's banner (runtime.logs) said the rest at INFO.
        log.debug(
            "taskwatch %s started: interval %.1fs, leader ttl %.1fs",
            self.leadership.owner,
            self.interval,
            self.leadership.ttl,
        )
        next_pass = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_pass:
                    self.run_once()
                    next_pass = time.monotonic() + self.interval
                elif self.leadership.leading:
                    # A pass interval longer than the TTL must not let the lease lapse.
                    self.leadership.renew()
                wait = min(next_pass - time.monotonic(), self.leadership.ttl / 3)
                self._stop.wait(max(0.0, wait))
        finally:
            self.leadership.resign()
            close_old_connections()
        log.info("taskwatch %s stopped", self.leadership.owner)

    def run_once(self) -> dict[str, int] | None:
        """One pass of every duty if this process leads (None if it does not); returns the counts."""
        # A pass may follow a long wait or a database restart: start it on a connection that works.
        connections.drop_unusable()
        if not self.leadership.renew():
            return None
        started = time.time()
        counts: dict[str, int] = {}
        for name, duty in self.duties:
            if not self.keep_going():
                break
            counts[name] = self._attempt(name, lambda duty=duty: duty(None, self.keep_going))
        if self.keep_going() and time.monotonic() >= self._next_reconcile:
            self._next_reconcile = time.monotonic() + self.reconcile_interval
            counts["reconcile_counters"] = self._attempt("reconcile_counters", reconcile_counters)
        # Parsed by the tests to prove two watchers never act at the same time.
        log.debug("%s acted from %.6f to %.6f", self.leadership.owner, started, time.time())
        return counts

    def _attempt(self, name: str, call: Callable[[], int]) -> int:
        try:
            return call()
        except DatabaseError as exc:
            log.warning("%s failed (%s); trying again next pass", name, exc)
            connections.drop_unusable()  # so the next duty reconnects if this one lost the server
        except Exception:
            # One broken duty must not stop the others, nor the next pass.
            log.exception("%s failed; trying again next pass", name)
        return 0
