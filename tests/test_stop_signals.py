"""SIGTERM stops a worker's loop however the signal falls (taskflow.runtime.stop_signals).

A handler that sets a `threading.Event` deadlocks when it interrupts the main thread inside a wait
on that same event. The loop here waits on its wake-up event as the claim loop does, and the
process is sent a SIGTERM every millisecond, so some of them land inside that wait: it must still stop.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from .conftest import REPO

PROCESS = textwrap.dedent(
    """
    import os, signal, threading, time
    from taskflow.runtime.stop_signals import run_until_stopped

    stopping, wake = threading.Event(), threading.Event()
    requests = 0

    def claim_loop():  # the shape of Runner's claim loop: wait for a wake-up, look again
        threading.Thread(target=pester, daemon=True).start()  # the handler is installed by now
        while not stopping.is_set():
            wake.wait(0)
            wake.clear()

    def request_stop():  # what Runner.request_stop does, but only the third call stops the loop
        global requests
        requests += 1
        wake.set()
        if requests >= 3:
            stopping.set()

    def pester():
        while not stopping.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.001)

    run_until_stopped(claim_loop, request_stop, name="loop")
    print("stopped after", requests, "requests", flush=True)
    """
)


def test_sigterm_stops_a_loop_waiting_on_the_event_its_stop_sets() -> None:
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", PROCESS], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("stopped after"), done.stdout


OTHER_SIGNAL = textwrap.dedent(
    """
    import os, signal, threading, time
    from taskflow.runtime.stop_signals import run_until_stopped

    stopping = threading.Event()
    seen = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))  # a project's own handler

    def loop():
        for _ in range(5):
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)
        assert not stopping.wait(0.3), "SIGUSR2 stopped the loop"
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.wait(5), "SIGTERM did not stop the loop"

    run_until_stopped(loop, stopping.set, name="loop")
    print("SIGUSR2 handled", len(seen), "times", flush=True)
    """
)


def test_only_sigterm_and_sigint_stop_the_loop_and_other_handlers_still_run() -> None:
    done = subprocess.run(
        [sys.executable, "-c", OTHER_SIGNAL], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "SIGUSR2 handled 5 times", done.stdout


def test_what_the_work_raises_reaches_the_caller() -> None:
    from taskflow.runtime.stop_signals import run_until_stopped

    def run() -> None:
        raise LookupError("from the work thread")

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_until_stopped(run, lambda: None, name="raising")
    except LookupError as exc:
        assert str(exc) == "from the work thread"
    else:
        raise AssertionError("the work's exception was swallowed")
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)  # pytest's own, back
