"""`manage.py taskflow run`: real worker and watcher processes, supervised, restarted, stopped, reloaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import taskflow
from taskflow.cli.supervisor import BACKOFF_MAX, Child, SourceWatch, Supervisor, backoff
from taskflow.engine import locks
from taskflow.models import Status, Task, WorkerProcess
from taskflow.runtime.leadership import LEADER_LOCK
from tests.conftest import wait_until

T = "test.record"


def children_of(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry))
    return found


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def log_of(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text()  # type: ignore[attr-defined]


def worker_pids(supervisor: subprocess.Popen) -> set[int]:
    """The pids of the alive workers registered by this supervisor's children."""
    kids = children_of(supervisor.pid)
    return {pid for pid in WorkerProcess.objects.values_list("pid", flat=True) if pid in kids}


def done(ids: list[int]) -> bool:
    return Task.objects.filter(pk__in=ids, status=Status.SUCCESS).count() == len(ids)


@pytest.mark.processes
def test_run_starts_workers_and_the_watcher_restarts_a_killed_worker_and_stops_all_on_sigterm(
    spawn: Callable[..., subprocess.Popen],
) -> None:
    sup = spawn("taskflow", "run", "--workers", "2", "--concurrency", "2", "--grace", "1", "--types", T)
    ids = [taskflow.enqueue(T, {"n": n}).id for n in range(6)]
    wait_until(lambda: done(ids), timeout=60)

    first = wait_until(lambda: len(worker_pids(sup)) == 2 and worker_pids(sup), timeout=30)
    assert len(children_of(sup.pid)) == 3  # two workers and the watcher
    (watcher,) = children_of(sup.pid) - first  # type: ignore[operator]
    wait_until(lambda: f":{watcher}:" in (locks.holder(LEADER_LOCK) or ""), timeout=30)  # it leads

    victim = min(first)  # type: ignore[type-var]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: gone(victim))
    again = wait_until(lambda: len(worker_pids(sup) - {victim}) == 2 and worker_pids(sup), timeout=30)
    assert victim not in again and len(again & first) == 1  # type: ignore[operator]
    assert "worker-" in log_of(sup) and "exited (signal 9)" in log_of(sup)
    more = [taskflow.enqueue(T, {"n": n}).id for n in range(4)]
    wait_until(lambda: done(more), timeout=60)

    everyone = children_of(sup.pid)
    assert len(everyone) == 3
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 0
    assert all(gone(pid) for pid in everyone)
    assert "stopping worker-1, worker-2, taskwatch (SIGTERM" in log_of(sup)
    assert not WorkerProcess.objects.filter(pid__in=everyone).exists()  # stopped cleanly: each forgot its row


@pytest.mark.processes
def test_run_reload_restarts_the_children_when_a_watched_file_changes(
    spawn: Callable[..., subprocess.Popen], tmp_path: Path
) -> None:
    source = tmp_path / "src" / "handlers.py"
    source.parent.mkdir()
    source.write_text("X = 1\n")
    sup = spawn("taskflow", "run", "--grace", "1", "--types", T, "--reload-dir", str(source.parent))
    before = wait_until(lambda: len(children_of(sup.pid)) == 2 and children_of(sup.pid), timeout=30)
    wait_until(lambda: worker_pids(sup), timeout=30)  # started for real, not just forked

    later = time.time() + 5
    os.utime(source, (later, later))
    after = wait_until(lambda: (kids := children_of(sup.pid)) and len(kids) == 2 and not kids & before and kids)
    assert all(gone(pid) for pid in before)  # type: ignore[union-attr]
    assert f"{source} changed: restarting every process" in log_of(sup)
    ids = [taskflow.enqueue(T, {"n": 1}).id]
    wait_until(lambda: done(ids), timeout=60)

    sup.send_signal(signal.SIGINT)  # Ctrl-C: the same orderly stop
    assert sup.wait(timeout=60) == 0
    assert all(gone(pid) for pid in after)  # type: ignore[union-attr]


def test_run_refuses_unknown_types_and_bad_worker_args_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_cli import cli

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the supervisor was started")

    # In this process the children would be this pytest run again (manage_command repeats sys.argv).
    monkeypatch.setattr("taskflow.management.commands.taskflow.Supervisor", never)
    status, _, err = cli("run", "--types", "no.such")
    assert status == 2 and err == "run: no handler registered for task type 'no.such'"
    status, _, err = cli("run", "--worker-args", '"unbalanced')
    assert status == 2 and err.startswith("run: ")
    assert cli("run", "--types", T) == (2, "", "run: start it from the command line: manage.py taskflow run")


# -- the supervisor in this process ----------------------------------------------------------------


def supervise(children: list[Child], seconds: float, grace: float = 5.0) -> list[str]:
    """Run a Supervisor on a thread for `seconds`, then stop it; what it said."""
    said: list[str] = []
    supervisor = Supervisor(children, grace=grace, say=said.append)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    time.sleep(seconds)
    supervisor.request_stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return said


def test_a_crash_loop_backs_off_instead_of_spinning() -> None:
    assert [backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, BACKOFF_MAX, BACKOFF_MAX]
    said = supervise([Child("crash", [sys.executable, "-c", "raise SystemExit(3)"])], seconds=4)
    starts = [line for line in said if line.startswith("started crash")]
    # Started at once, then after 1 s and 2 s more: a loop without back-off would have started it dozens of times.
    assert 2 <= len(starts) <= 4, said
    assert "crash exited (status 3)" in said[1] and said[1].endswith("starting it again in 1 s")
    assert any(line.endswith("starting it again in 2 s") for line in said)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    child = Child("stubborn", [sys.executable, "-c", stubborn])
    said = supervise([child], seconds=1.5, grace=0.5)
    assert "stubborn still running: SIGKILL" in said
    assert child.proc is None  # waited for


def test_source_watch_sees_changed_new_and_removed_files_but_not_caches_or_virtualenvs(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "tasks.py").write_text("")
    for skipped in (".git", "__pycache__", "venv"):
        (tmp_path / skipped).mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("")
    watch = SourceWatch([tmp_path])
    assert watch.changed() is None
    for skipped in (".git", "__pycache__", "venv"):
        (tmp_path / skipped / "x.py").write_text("")
    (tmp_path / "app" / "notes.txt").write_text("")
    assert watch.changed() is None
    later = time.time() + 5
    os.utime(tmp_path / "app" / "tasks.py", (later, later))
    assert watch.changed() == tmp_path / "app" / "tasks.py"
    (tmp_path / "app" / "new.py").write_text("")
    assert watch.changed() == tmp_path / "app" / "new.py"
    (tmp_path / "app" / "new.py").unlink()
    assert watch.changed() == tmp_path / "app" / "new.py"
    assert watch.changed() is None
