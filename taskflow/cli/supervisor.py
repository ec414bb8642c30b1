"""`manage.py taskflow run`: N `taskworker` processes and one `taskwatch`, kept running and stopped together.

A child that exits is started again after a back-off (1 s, doubling to 30 s while it keeps dying
within 30 s of its start), so a crash loop does not spin. SIGTERM or SIGINT stops every child: each
gets SIGTERM (a worker finishes or hands back its tasks within its grace), and any still running
after the grace period gets SIGKILL. Children run in their own process group, so a terminal's
Ctrl-C reaches only the supervisor, which stops them in that order; on Linux they also get SIGTERM
if the supervisor itself dies (PR_SET_PDEATHSIG), so none is left behind.

With `reload`, every `.py` file under the watched folders is polled once a second (modification
time, and files added or removed); on a change every child is stopped and started again, as
`runserver` restarts itself. Polling rather than django.utils.autoreload: the code to watch is
what the children import, which this process never loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from django.utils import autoreload

BACKOFF_FIRST = 1.0  # seconds before the first restart
BACKOFF_MAX = 30.0
STABLE_AFTER = 30.0  # a child that ran this long before dying starts its back-off afresh
POLL = 0.2  # seconds between looks at the children
RELOAD_POLL = 1.0  # seconds between looks at the source files
SKIPPED_DIRS = {"__pycache__", "node_modules", "site-packages", "var", "build", "dist"}
PR_SET_PDEATHSIG = 1


def manage_command(*args: str) -> list[str]:
    """The command line that runs `manage.py <args>` as this process was run (script, -m django, django-admin)."""
    this = autoreload.get_child_arguments()
    return [*map(str, this[: len(this) - (len(sys.argv) - 1)]), *args]


def backoff(failures: int) -> float:
    """Seconds before restarting a child that died `failures` times in a row (1 for the first)."""
    return min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, failures - 1))


@dataclass
class Child:
    """One supervised process: its name, its command line, and how it has fared."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # deaths in a row, each within STABLE_AFTER of its start
    restart_at: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, process_group=0, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.started_at = time.monotonic()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Supervisor:
    """Starts the children, restarts the ones that die, and stops them all when asked."""

    children: list[Child]
    grace: float  # seconds between SIGTERM and SIGKILL when stopping
    say: Callable[[str], None]
    reload_dirs: Sequence[Path] = ()
    _stopping: bool = field(default=False, init=False)
    _hurry: bool = field(default=False, init=False)

    def request_stop(self) -> None:
        """Stop every child and return from run(); asked twice, kill them without waiting for the grace."""
        self._hurry = self._stopping
        self._stopping = True

    def run(self) -> None:
        sources = SourceWatch(self.reload_dirs) if self.reload_dirs else None
        next_scan = time.monotonic() + RELOAD_POLL
        for child in self.children:
            self._start(child)
        while not self._stopping:
            now = time.monotonic()
            for child in self.children:
                self._tend(child, now)
            if sources is not None and now >= next_scan:
                next_scan = now + RELOAD_POLL
                changed = sources.changed()
                if changed:
                    self.say(f"{changed} changed: restarting every process")
                    self.stop_children()
                    for child in self.children:
                        child.failures = 0
                        self._start(child)
            time.sleep(POLL)
        self.stop_children()

    def _start(self, child: Child) -> None:
        child.start()
        self.say(f"started {child.name} (pid {child.proc.pid if child.proc else '?'})")

    def _tend(self, child: Child, now: float) -> None:
        if child.proc is None:
            if now >= child.restart_at:
                self._start(child)
            return
        code = child.proc.poll()
        if code is None:
            return
        ran = now - child.started_at
        child.failures = 1 if ran >= STABLE_AFTER else child.failures + 1
        delay = backoff(child.failures)
        child.proc, child.restart_at = None, now + delay
        how = f"signal {-code}" if code < 0 else f"status {code}"
        self.say(f"{child.name} exited ({how}) after {ran:.1f} s; starting it again in {delay:g} s")

    def stop_children(self) -> None:
        """SIGTERM to every running child, SIGKILL to those still running after the grace period."""
        running = [c for c in self.children if c.running()]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        if running:
            self.say(f"stopping {', '.join(c.name for c in running)} (SIGTERM; SIGKILL after {self.grace:g} s)")
        deadline = time.monotonic() + self.grace
        while any(c.running() for c in running) and time.monotonic() < deadline and not self._hurry:
            time.sleep(0.05)
        for child in running:
            if child.running():
                self.say(f"{child.name} still running: SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()  # type: ignore[union-attr]
            child.proc.wait()  # type: ignore[union-attr]
            child.proc = None


class SourceWatch:
    """The `.py` files under some folders, and whether any changed, appeared or went since last asked."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.dirs = [Path(d).resolve() for d in dirs]
        self.seen = self.snapshot()

    def snapshot(self) -> dict[Path, int]:
        found = {}
        for path in self._files():
            with contextlib.suppress(OSError):  # removed while walking
                found[path] = path.stat().st_mtime_ns
        return found

    def changed(self) -> Path | None:
        """One changed path (or None), remembering the files as they are now."""
        now = self.snapshot()
        before, self.seen = self.seen, now
        for path in sorted(now.keys() | before.keys()):
            if now.get(path) != before.get(path):
                return path
        return None

    def _files(self) -> Iterator[Path]:
        for top in self.dirs:
            for root, dirs, files in os.walk(top):
                # Hidden folders, caches and virtualenvs (a pyvenv.cfg) hold no project code.
                dirs[:] = [
                    d
                    for d in dirs
                    if not d.startswith(".") and d not in SKIPPED_DIRS and not Path(root, d, "pyvenv.cfg").exists()
                ]
                yield from (Path(root, f) for f in files if f.endswith(".py"))


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervisor dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
