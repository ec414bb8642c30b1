"""End to end: the example project served by gunicorn (2 processes) and two remote worker processes
drain 500 tasks over HTTP, through a 5-second server outage, each task ending exactly once; and a
hold_task token's attacks on a remote and a local worker's attempts are refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.utils import timezone

import taskflow
from taskflow.models import Status, Task, WorkerProcess

from .conftest import REPO, peak_overlap, read_runs, wait_until
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
    options = ["--types", "test.record,test.flaky,test.control", "--concurrency", "8"]
    options += ["--poll-interval", "0.2", "--beat-interval", "1", "--grace", "10"]
    workers = [start_remote(gunicorn.url, token, *options) for _ in range(2)]
    # Both are polling before there is work: one that started late on a loaded machine would
    # otherwise meet the outage first, back off, and find the other has drained everything.
    wait_until(lambda: sum("test.record" in w.task_types for w in WorkerProcess.objects.all()) == 2, timeout=60)

    records = taskflow.enqueue_many(
        [{"task_type": "test.record", "payload": {"n": n, "sleep": 0.02}} for n in range(440)]
    )
    flaky = taskflow.enqueue_many([{"task_type": "test.flaky", "payload": {"succeed_on": 2}} for _ in range(40)])
    staged = taskflow.enqueue_many([{"task_type": "test.control", "payload": {"action": "stages"}} for _ in range(20)])
    ids = [t.pk for t in (*records, *flaky, *staged)]
    assert len(ids) == 500

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
    # claims) are exactly the tasks handed back unstarted: by a beat (a hold whose answer was lost) or a worker.
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
    # And the tasks claimed ahead that the workers handed back themselves, unstarted (waited too long, or at the stop).
    handed_back += sum(int(n) for n in re.findall(r"handed back (\d+) unstarted task", logs))
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


def test_attacks_by_a_hold_task_token_on_remote_and_local_workers_attempts_are_refused(
    gunicorn: Gunicorn, start_remote, spawn, run_log: Path, tmp_path: Path
) -> None:
    """The review's attacks over HTTP while a remote and a local worker run: each task runs once, as its handler."""
    # The handlers run until the attacks are over (the gate), however slowly the two workers start.
    gate = tmp_path / "attacks-over"
    tasks = [taskflow.enqueue("test.sleep", {"seconds": 60, "gate": str(gate)}) for _ in range(4)]
    ids = {str(t.pk) for t in tasks}
    remote_proc = start_remote(
        gunicorn.url, api_token("remote-worker", "hold_task"), "--types", "test.sleep", "--concurrency", "2"
    )
    local_proc = spawn("taskworker", "--types", "test.sleep", "--concurrency", "2")
    wait_until(lambda: {r[0] for r in read_runs(run_log) if r[2] == "start"} == ids, timeout=60)
    running = list(Task.objects.filter(pk__in=[t.pk for t in tasks]).values("id", "worker_id", "lease_token"))
    assert len({r["worker_id"] for r in running}) == 2  # both workers hold attempts
    # Claimed long ago, as far as a liveness beat's hand-back can tell.
    Task.objects.filter(pk__in=[t.pk for t in tasks]).update(started_at=timezone.now() - timedelta(seconds=30))
    before = {r["id"]: Task.objects.filter(pk=r["id"]).values().get() for r in running}

    session = requests.Session()
    session.headers["Authorization"] = f"Token {api_token('attacker', 'hold_task')}"
    api = gunicorn.url

    def post(path: str, body: dict, **headers: str) -> requests.Response:
        return session.post(api + path, json=body, headers=headers, timeout=10)

    for attempt in running:
        task_id, victim, lease = attempt["id"], attempt["worker_id"], attempt["lease_token"]
        # The foreign beat (the victim's id named) and the forged report (a guessed lease), as reviewed.
        assert post("tasks/heartbeat/", {"worker_id": victim, "items": []}).status_code == 403
        forged = {"lease": lease, "status": "success", "result": {"forged": True}}
        assert post(f"tasks/{task_id}/set/", forged).status_code == 403
        # The victim's id in the credential headers, with a made-up key.
        spoof = {"Taskflow-Worker-Id": victim, "Taskflow-Worker-Key": "0" * 64}
        answer = post("tasks/heartbeat/", {"beat": True, "items": []}, **spoof)
        assert (answer.status_code, answer.json()["error"]) == (403, "worker_refused")
        assert post(f"tasks/{task_id}/set/", {**forged, "attempt_key": "0" * 64}, **spoof).status_code == 403

    # A registered attacker: its own beat hands nothing of theirs back, its forged reports are refused.
    answer = post("workers/", {"host": "attacker", "pid": 1, "task_types": ["test.sleep"], "concurrency": 1})
    assert answer.status_code == 201
    own = {"Taskflow-Worker-Id": answer.json()["worker_id"], "Taskflow-Worker-Key": answer.json()["worker_key"]}
    items = [{"task_id": str(a["id"]), "lease": a["lease_token"], "attempt_key": "0" * 64} for a in running]
    answer = post("tasks/heartbeat/", {"beat": True, "items": items}, **own)
    assert answer.status_code == 200 and answer.json()["handed_back"] == 0
    assert {r["error"] for r in answer.json()["results"]} == {"forbidden"}
    reports = [{**item, "status": "success", "result": {"forged": True}} for item in items]
    for path, body in (("tasks/set/", {"items": reports}), ("tasks/release/", {"items": items})):
        answer = post(path, body, **own)
        assert answer.status_code == 200 and {r["error"] for r in answer.json()["results"]} == {"forbidden"}
    for item in reports:
        assert (
            post(f"tasks/{item['task_id']}/set/", {k: v for k, v in item.items() if k != "task_id"}, **own).json()[
                "error"
            ]
            == "forbidden"
        )
    for attempt in running:
        assert Task.objects.filter(pk=attempt["id"]).values().get() == before[attempt["id"]]

    gate.touch()
    wait_until(lambda: Task.objects.filter(pk__in=[t.pk for t in tasks], status__in=FINAL).count() == 4, timeout=60)
    for task in tasks:
        got = Task.objects.get(pk=task.pk)
        assert (got.status, got.attempts, got.result) == (Status.SUCCESS, 1, {"slept": 60})
    runs = [r for r in read_runs(run_log) if r[0] in ids]
    assert Counter((r[0], r[2]) for r in runs) == Counter({(i, what): 1 for i in ids for what in ("start", "end")})
    for proc in (remote_proc, local_proc):
        proc.send_signal(signal.SIGTERM)
    assert remote_proc.wait(timeout=30) == 0, output(remote_proc)
    assert local_proc.wait(timeout=30) == 0


def _reserved(ids: list[int]) -> set[int]:
    """Those of these tasks claimed ahead and not started: processing, with no start time."""
    rows = Task.objects.filter(pk__in=ids, status=Status.PROCESSING, started_at=None)
    return set(rows.values_list("pk", flat=True))


def test_a_killed_remote_workers_reserved_tasks_run_again_at_once_their_attempt_uncounted(
    gunicorn: Gunicorn, start_remote, spawn, run_log: Path
) -> None:
    token = api_token("remote-worker", "hold_task")
    # Quick tasks first, so the worker holds ahead at their pace; then a slow one its one thread is
    # stuck in, and tasks behind it, some of which it holds reserved (a long PREFETCH_WAIT keeps them).
    # Their pace (a nap of 50 ms each) starts few ahead of the thread (REMOTE_START_AHEAD of it) and holds many more.
    quick = {"task_type": "test.sleep", "payload": {"seconds": 0.01}, "priority": 10}
    taskflow.enqueue_many([dict(quick) for _ in range(60)])
    slow = taskflow.enqueue("test.sleep", {"seconds": 600}, priority=5)
    behind = taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 0}} for _ in range(300)])
    ids = [t.pk for t in behind]
    options = ["--types", "test.sleep", "--concurrency", "1", "--prefetch-wait", "600", "--poll-interval", "0.2"]
    doomed = start_remote(gunicorn.url, token, *options)
    wait_until(lambda: any(r[0] == str(slow.pk) and r[2] == "start" for r in read_runs(run_log)), timeout=120)
    wait_until(lambda: _reserved(ids), timeout=30)
    time.sleep(0.5)  # past REMOTE_START_AHEAD of the thread's last pace: nothing more is started ahead
    held = _reserved(ids)
    started_ahead = set(Task.objects.filter(pk__in=ids, status=Status.PROCESSING).values_list("pk", flat=True)) - held
    assert len(held) > len(started_ahead), output(doomed)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=10)
    killed_at = time.monotonic()

    spawn("taskwatch")
    spawn("taskworker", "--types", "test.sleep", "--concurrency", "4")
    wait_until(lambda: Task.objects.filter(pk__in=held, status=Status.SUCCESS).count() == len(held), timeout=60)
    # At once when taskwatch sees the worker dead (LIVENESS_TIMEOUT 3 s), not after their lease.
    assert time.monotonic() - killed_at < 30
    # Handed back uncounted: each ran once, its one attempt counted once.
    assert set(Task.objects.filter(pk__in=held, attempts=1).values_list("pk", flat=True)) == held
    runs = Counter(r[0] for r in read_runs(run_log) if r[2] == "start")
    assert all(runs[str(pk)] == 1 for pk in held)
    # Those started ahead of the thread count an attempt, as a running one does, and are not lost either.
    wait_until(lambda: Task.objects.filter(pk__in=started_ahead, status=Status.SUCCESS).count() == len(started_ahead))


def test_a_limit_under_remote_claim_ahead_never_has_more_running_than_allowed(
    gunicorn: Gunicorn, start_remote, run_log: Path
) -> None:
    from taskflow.engine.configs import configs
    from taskflow.models import ScheduleCfg

    token = api_token("remote-worker", "hold_task")
    configs.get("test.sleep")
    ScheduleCfg.objects.filter(pk="test.sleep").update(concurrency_limit=2)
    configs.clear()
    tasks = taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 0.1}} for _ in range(40)])
    options = ["--types", "test.sleep", "--concurrency", "4", "--burst", "--poll-interval", "0.2"]
    workers = [start_remote(gunicorn.url, token, *options) for _ in range(3)]
    for proc in workers:
        assert proc.wait(timeout=120) == 0, output(proc)
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], attempts=1).count() == 40
    # Nothing was reserved (every hold started its tasks), and at no moment did more than 2 run.
    assert not Task.objects.filter(pk__in=[t.pk for t in tasks], lease_token__gt=1).exists()
    assert peak_overlap(run_log) <= 2
