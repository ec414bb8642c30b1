"""Long-running loops that never die silently.

Each of a worker's loops (claiming, reporting, liveness, the wake-up listener, every handler
thread) runs as a `Loop`: it calls its step again and again. An outage (the errors its channel
names: the database or Redis for the local worker, an unreachable server for the remote one) is
waited out with a growing pause and never ends the loop: the services come back, and the work
waits for them. Any other error is logged with its traceback and the loop goes on after a pause; only a loop
that cannot go on — it failed GIVE_UP_AFTER times in a row, or its thread died of something it
could not catch — calls `on_fatal`, so the worker can stop heartbeating and exit for its supervisor
to restart it (taskwatch then rescues what it held) instead of running on half-dead.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

log = logging.getLogger("taskflow.worker")

GIVE_UP_AFTER = 5  # unexpected errors in a row before a loop is declared unable to go on
FIRST_PAUSE = 0.5  # seconds after the first error; doubled after each one in a row
MAX_PAUSE = 10.0

Step = Callable[[], bool | None]


class Loop:
    """Calls `step` until it returns False or `stop` is set, surviving its errors (see the module doc)."""

    def __init__(
        self,
        name: str,
        step: Step,
        *,
        on_fatal: Callable[[str], None],
        stop: threading.Event | None = None,
        outages: tuple[type[BaseException], ...] = (),
        on_outage: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """`outages`: errors that are waited out however long (then `on_outage` is called, e.g. so every
        thread checks its connections); `on_exit`: called on the loop's thread as it ends."""
        self.name, self.step, self.on_fatal = name, step, on_fatal
        self.stop = stop or threading.Event()
        self.outages, self.on_outage, self.on_exit = outages, on_outage, on_exit

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, or a failure while handling an error
            try:
                log.critical("%s died", self.name, exc_info=True)
            finally:
                self.on_fatal(f"{self.name} died: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        failures = outages = 0
        while not self.stop.is_set():
            try:
                if self.step() is False:
                    return
                failures = outages = 0
            except self.outages as exc:
                outages += 1
                if self.on_outage is not None:
                    self.on_outage()
                pause = _pause(outages)
                log.warning("%s: %s: %s; trying again in %.1fs", self.name, type(exc).__name__, exc, pause)
                self.stop.wait(pause)
            except Exception as exc:
                failures += 1
                log.exception("%s failed unexpectedly (%d in a row)", self.name, failures)
                if failures >= GIVE_UP_AFTER:
                    self.on_fatal(f"{self.name} failed {failures} times in a row: {type(exc).__name__}: {exc}")
                    return
                self.stop.wait(_pause(failures))

    def start_thread(self) -> threading.Thread:
        """Run this loop on a new daemon thread named after it."""
        # Daemon: a handler stuck forever must not keep the process alive at exit.
        thread = threading.Thread(target=self._run_then_disconnect, name=self.name, daemon=True)
        thread.start()
        return thread

    def _run_then_disconnect(self) -> None:
        try:
            self.run()
        finally:
            if self.on_exit is not None:
                self.on_exit()  # e.g. a finished thread's connections would stay open until exit


def _pause(errors_in_a_row: int) -> float:
    # Jittered, so processes that met the same outage do not all come back at the same instant.
    return min(MAX_PAUSE, FIRST_PAUSE * 2 ** min(errors_in_a_row - 1, 10)) * random.uniform(0.5, 1.0)
