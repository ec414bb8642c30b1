"""Stop a long-running process on SIGTERM or SIGINT without the risk of deadlocking it.

Python runs a signal handler in the main thread, between two bytecodes of whatever that thread was
doing, possibly while it holds a lock. A handler that asks a worker to stop sets a
`threading.Event`, which takes the event's lock; if the main thread was inside `Event.wait()` on
that same event (the claim loop waits on its wake-up event), the handler waits forever for a lock
its own thread holds. CI saw exactly that: a worker that never exited after SIGTERM.

So the handler does nothing itself. Python's own C-level handler writes the signal's number to a
pipe (`signal.set_wakeup_fd`); the work runs on a thread of its own, and the main thread waits on that
pipe and on one the work writes to when it ends, then passes a stop on: it holds no lock there, and
whatever lock `request_stop` takes is released by the thread that holds it. The main thread sleeps
until one of the two happens (no periodic wake-ups: those cost a busy worker's start latency).
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_until_stopped(run: Callable[[], None], request_stop: Callable[[], None], *, name: str) -> None:
    """Call `run()` on a thread named `name`; SIGTERM and SIGINT call `request_stop()`.

    Returns when `run` returns, and raises what it raised. Call it from the main thread.
    """
    raised: list[BaseException] = []
    ended_r, ended_w = os.pipe()
    signals_r, signals_w = os.pipe()
    os.set_blocking(signals_w, False)  # as set_wakeup_fd requires: a signal never waits for the reader

    def work() -> None:
        try:
            run()
        except BaseException as exc:  # handed to the main thread, which raises it
            raised.append(exc)
        finally:
            os.write(ended_w, b".")

    thread = threading.Thread(target=work, name=name)
    previous_fd = signal.set_wakeup_fd(signals_w, warn_on_full_buffer=False)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _noted)
    try:
        thread.start()
        while True:
            ready, _, _ = select.select([ended_r, signals_r], [], [])
            # Each byte is a signal's number: any signal with a Python handler (a project's own too) is written.
            if signals_r in ready and any(signum in STOP_SIGNALS for signum in os.read(signals_r, 512)):
                request_stop()
            if ended_r in ready:
                break
        thread.join()
    finally:
        signal.set_wakeup_fd(previous_fd)
        for fd in (ended_r, ended_w, signals_r, signals_w):
            os.close(fd)
    if raised:
        raise raised[0]


def _noted(signum: int, frame: object) -> None:
    """The Python-level handler: nothing to do, the wake-up pipe has carried the signal to the main thread."""
