"""End to end: the example project served by gunicorn (2 processes) and two remote worker processes
drain 500 tasks over HTTP, through a 5-second server outage, each task ending exactly once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

import taskflow
from taskflow.models import Status, Task

from .conftest import REPO, read_runs, wait_until
from .remote_support import api_token, free_port, require_liveness_beat

pytestmark = pytest.mark.processes

FINAL = (Status.SUCCESS, Status.FAILED, Status.STOPPED)


class Gunicorn:
    """The example project under gunicorn on a loopback port, which the test can kill and start again."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api/"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"gunicorn-{self.starts}.log", "wb")  # noqa: SIM115 - closed with the process
        command = [sys.executable, "-m", "gunicorn", "project.wsgi:application", "--bind", f"127.0.0.1:{self.port}"]
        command += ["--workers", "2", "--worker-class", "gthread", "--threads", "4", "--graceful-timeout", "5"]
        command += ["--no-control-socket"]  # its default path is shared by every gunicorn of the user
        # A session of its own, so killing its process group takes the master and both workers at once.
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_until(self._answers, timeout=60, interval=0.2)

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "gunicorn exited"
        try:
            return requests.get(self.url + "tasks/", timeout=2).status_code in (401, 403)
        except requests.RequestException:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def gunicorn(process_env: dict[str, str], tmp_path: Path) -> Iterator[Gunicorn]:
    server = Gunicorn(process_env, tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def start_remote(process_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `python -m taskflow.remote` with no Django settings; every one still running is killed at teardown."""
    procs: list[subprocess.Popen] = []
    env = {k: v for k, v in process_env.items() if k not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL")}

    def start(url: str, token: str, *args: str) -> subprocess.Popen:
        token_file = tmp_path / "token"
        token_file.write_text(token)
        log = open(tmp_path / f"remote-{len(procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        command = [sys.executable, "-m", "taskflow.remote", "--url", url, "--token-file", str(token_file)]
        command += ["--handlers", "tests.taskapp.tasks", *args]
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = log.name  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def output(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text()  # type: ignore[attr-defined]


def test_two_remote_workers_drain_500_tasks_through_a_server_outage_each_ending_once(
    gunicorn: Gunicorn, start_remote, run_log: Path
) -> None:
    token = api_token("remote-worker", "hold_task")
    # A hold whose answer the outage swallows is recovered only by the beat's hand-back.
    require_liveness_beat(gunicorn.url, token)
    records = taskflow.enqueue_many(
        [{"task_type": "test.record", "payload": {"n": n, "sleep": 0.02}} for n in range(440)]
    )
    flaky = taskflow.enqueue_many([{"task_type": "test.flaky", "payload": {"succeed_on": 2}} for _ in range(40)])
    staged = taskflow.enqueue_many([{"task_type": "test.control", "payload": {"action": "stages"}} for _ in range(20)])
    ids = [t.pk for t in (*records, *flaky, *staged)]
    assert len(ids) == 500

    options = ["--types", "test.record,test.flaky,test.control", "--concurrency", "8"]
    options += ["--poll-interval", "0.2", "--beat-interval", "1", "--grace", "10"]
    workers = [start_remote(gunicorn.url, token, *options) for _ in range(2)]

    # The server goes away for 5 seconds in the middle of the drain, with attempts running.
    wait_until(lambda: len(read_runs(run_log)) >= 150, timeout=120)
    gunicorn.kill()
    done_at_kill = Task.objects.filter(pk__in=ids, status__in=FINAL).count()
    assert done_at_kill < 500
    time.sleep(5)
    gunicorn.start()

    try:
        wait_until(lambda: Task.objects.filter(pk__in=ids, status__in=FINAL).count() == 500, timeout=240, interval=0.5)
    except AssertionError:
        counts = Counter(Task.objects.filter(pk__in=ids).values_list("status", flat=True))
        raise AssertionError(f"not drained: {dict(counts)}\n" + "".join(output(p)[-2000:] for p in workers)) from None
    for proc in workers:
        proc.send_signal(signal.SIGTERM)
    for proc in workers:
        assert proc.wait(timeout=60) == 0, output(proc)

    # Reports really were held back by the outage and delivered afterwards, not dropped.
    logs = "".join(output(p) for p in workers)
    assert "kept until the server answers" in logs, logs[-3000:]

    rows = {t.pk: t for t in Task.objects.filter(pk__in=ids)}
    runs: dict[str, list[list[str]]] = defaultdict(list)
    for run in read_runs(run_log):
        runs[run[0]].append(run)
    assert Counter(t.status for t in rows.values()) == Counter({Status.SUCCESS: 500})
    # Every attempt ran once and was reported once. Claims beyond the attempts (lease_token counts
    # claims) are exactly the holds whose answer the outage swallowed, handed back by a beat unstarted.
    extra_claims = 0
    for n, task in enumerate(records):
        got = rows[task.pk]
        assert (got.attempts, got.result, len(got.schedule_log)) == (1, {"n": n}, 1)
        assert [r[1] for r in runs[str(task.pk)]] == ["1"]
        extra_claims += got.lease_token - 1
    for task in flaky:
        got = rows[task.pk]
        assert (got.attempts, got.result, len(got.schedule_log)) == (2, {"attempt": 2}, 2)
        assert sorted(r[1] for r in runs[str(task.pk)]) == ["1", "2"]
        extra_claims += got.lease_token - 2
    for task in staged:
        got = rows[task.pk]
        assert (got.stage, len(got.schedule_log)) == ("second", 2)
        assert got.result == {"stage": "second", "context": {"from": "first"}, "checkpoint": None}
        assert len(runs[str(task.pk)]) == 2
        extra_claims += got.lease_token - 2
    assert set(runs) == {str(i) for i in ids}
    handed_back = sum(int(n) for n in re.findall(r"the server handed back (\d+) task", logs))
    assert extra_claims == handed_back
    # Both workers took part.
    assert len({r[3] for rs in runs.values() for r in rs}) == 2


def test_sigterm_lets_running_remote_tasks_finish_and_reports_them_before_exiting(
    gunicorn: Gunicorn, start_remote, run_log: Path
) -> None:
    token = api_token("remote-worker", "hold_task")
    tasks = [taskflow.enqueue("test.sleep", {"seconds": 1.5}) for _ in range(5)]
    proc = start_remote(gunicorn.url, token, "--types", "test.sleep", "--concurrency", "2", "--grace", "10")
    wait_until(lambda: len(read_runs(run_log)) >= 2, timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, output(proc)

    started = {r[0] for r in read_runs(run_log) if r[2] == "start"}
    assert len(started) == 2
    for task in tasks:
        got = Task.objects.get(pk=task.pk)
        # What was running finished and was reported before the exit; nothing else was started.
        expected = (Status.SUCCESS, 1) if str(task.pk) in started else (Status.PENDING, 0)
        assert (got.status, got.attempts) == expected
    assert {r[0] for r in read_runs(run_log) if r[2] == "end"} == started
