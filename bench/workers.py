"""Worker processes started by the benchmark: spawned in their own session, always reaped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class WorkerPool:
    """Starts `manage.py` processes and guarantees that every one of them is gone at `close()`."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def start(
        self, *args: str, env: dict[str, str] | None = None, wrapper: list[str] | None = None
    ) -> subprocess.Popen:
        """Start `manage.py <args>` (optionally under `wrapper`, e.g. a profiler) with output to a log file."""
        log_path = self.log_dir / f"proc-{len(self.procs):03d}.log"
        command = [*(wrapper or []), sys.executable, str(ROOT / "manage.py"), *args]
        with open(log_path, "wb") as log:
            # A session of its own, so a profiler wrapper and its child can be signalled together.
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> bool:
        """Wait for `procs` to exit by themselves; False if any is still running after `timeout`."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
        """Ask `procs` to shut down gracefully (SIGTERM), then kill whatever is left after `timeout`."""
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        if not self.wait(procs, timeout):
            for proc in procs:
                _signal(proc, signal.SIGKILL)
            self.wait(procs, 10.0)

    def close(self) -> None:
        """Stop every process this pool started that is still running."""
        self.stop([p for p in self.procs if p.poll() is None], timeout=10.0)

    @staticmethod
    def tail(proc: subprocess.Popen, lines: int = 15) -> str:
        path: Path = proc.log_path  # type: ignore[attr-defined]
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _signal(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is not None:
        return
    # The group id is the child's own pid (start_new_session); it reaches a profiler's child too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)
