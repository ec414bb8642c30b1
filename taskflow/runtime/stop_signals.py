"""Stop a long-running process on SIGTERM or SIGINT without the risk of deadlocking it.

Python runs a signal handler in the main thread, between two bytecodes of whatever that thread was
doing, possibly while it holds a lock. A handler that asks a worker to stop sets a
`threading.Event`, which takes the event's lock; if the main thread was inside `Event.wait()` on
that same event (the claim loop waits on its wake-up event), the handler waits forever for a lock
its own thread holds. CI saw exactly that: a worker that never exited after SIGTERM.

So the handler only notes the signal, which takes no lock, and the work runs on a thread of its own
while the main thread waits for it and, between two short waits, passes the request on: it holds no
lock there, and whatever lock `request_stop` takes is released by the thread that holds it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

JOIN_STEP = 0.1  # seconds between the main thread's looks for a signal (the most a stop waits to be passed on)


def run_until_stopped(run: Callable[[], None], request_stop: Callable[[], None], *, name: str) -> None:
    """Call `run()` on a thread named `name`; SIGTERM and SIGINT call `request_stop()`.

    Returns when `run` returns, and raises what it raised.
    """
    raised: list[BaseException] = []

    def work() -> None:
        try:
            run()
        except BaseException as exc:  # handed to the main thread, which raises it
            raised.append(exc)

    signalled: list[int] = []

    def note(signum: int, frame: object) -> None:
        signalled.append(signum)  # a list's append takes no lock a thread could be holding

    thread = threading.Thread(target=work, name=name)
    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    thread.start()
    while thread.is_alive():
        thread.join(JOIN_STEP)
        if signalled:
            signalled.clear()
            request_stop()
    if raised:
        raise raised[0]
