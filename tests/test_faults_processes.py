"""Real processes under faults: one bad result among many, a worker whose liveness thread dies, and
a MariaDB restart under load (on a server of the test's own)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import taskflow
from taskflow.models import Status, Task

from .conftest import REPO, read_runs, wait_until

pytestmark = pytest.mark.processes


def output(proc) -> str:  # noqa: ANN001
    return Path(proc.log_path).read_text()


def test_a_bad_signal_and_a_2mb_result_fail_only_their_own_task_while_the_rest_land(spawn) -> None:
    specs = [{"task_type": "test.record", "payload": {"n": i}} for i in range(50)]
    specs += [{"task_type": "test.misbehave", "payload": {"size": 1_000_000}} for _ in range(20)]
    specs += [
        {"task_type": "test.misbehave", "payload": {"action": "priority"}},
        {"task_type": "test.misbehave", "payload": {"action": "refused_by_database"}},
        {"task_type": "test.misbehave", "payload": {"size": 2_000_000}},
    ]
    tasks = taskflow.enqueue_many(specs)
    worker = spawn("taskworker", "--types", "test.record,test.misbehave", "--concurrency", "24", "--burst")
    assert worker.wait(timeout=120) == 0, output(worker)  # a burst worker exits once everything is written

    rows = Task.objects.in_bulk([t.pk for t in tasks])
    *good, priority, refused, two_mb = [rows[t.pk] for t in tasks]
    assert [r.status for r in good] == [Status.SUCCESS] * 70
    assert all(len(r.result["data"]) == 1_000_000 - 12 for r in good[50:])
    assert (priority.status, priority.attempts) == (Status.FAILED, 1)
    assert priority.status_msg.startswith("InvalidTask: NextStage priority must be an integer from -100 to 100")
    assert refused.status == Status.FAILED
    assert refused.status_msg.startswith("the database refused this attempt's report: IntegrityError")
    # Stored JSON is limited to MAX_PAYLOAD_BYTES (1 MiB by default): the worker checks results with
    # validation.json_text, so a 2 MB one fails its own task.
    assert (two_mb.status, two_mb.attempts, two_mb.result) == (Status.FAILED, 1, None)
    assert two_mb.status_msg.startswith("InvalidTask: result")


def test_a_worker_whose_liveness_thread_dies_exits_non_zero_and_its_tasks_run_elsewhere(spawn, run_log) -> None:  # noqa: ANN001
    tasks = [taskflow.enqueue("test.sleep", {"seconds": 2}) for _ in range(2)]
    broken = spawn(
        "taskworker", "--types", "test.sleep", "--concurrency", "2", env={"TASKFLOW_TEST_LIVENESS_DIES_AFTER": "3"}
    )
    wait_until(lambda: len(read_runs(run_log)) >= 1, timeout=60)

    # It stops at once (no grace period: it no longer beats), with one line for its supervisor.
    assert broken.wait(timeout=30) == 1, output(broken)
    errors = [line for line in output(broken).splitlines() if line.startswith("CommandError:")]
    assert errors == ["CommandError: taskflow-liveness died: SystemExit: injected: the liveness thread dies"]

    spawn("taskwatch")
    healthy = spawn("taskworker", "--types", "test.sleep", "--concurrency", "2")
    wait_until(lambda: Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS).count() == 2, 60)
    healthy.send_signal(signal.SIGTERM)
    assert healthy.wait(timeout=30) == 0
    # What the broken worker had started it reported as interrupted before exiting: not rescued
    # after its silence, and not left running while another worker ran it.
    broken_id = read_runs(run_log)[0][3]
    started_there = {r[0] for r in read_runs(run_log) if r[3] == broken_id}
    for row in Task.objects.filter(pk__in=[int(t) for t in started_there]):
        first = row.schedule_log[-1]
        assert (first["worker"], first["outcome"]) == (broken_id, "error")
        assert first["error"].startswith("interrupted")


# -- a MariaDB restart under load ---------------------------------------------------------------------

MARIADBD = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OwnMariaDB:
    """A throwaway mariadbd on a free port, with its own data directory under /tmp."""

    def __init__(self, home: Path) -> None:
        self.home, self.port = home, free_port()
        (home / "data").mkdir()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [
            MARIADBD,
            "--no-defaults",
            f"--datadir={self.home / 'data'}",
            f"--socket={self.home / 'sock'}",
            f"--pid-file={self.home / 'pid'}",
            f"--log-error={self.home / 'error.log'}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            "--skip-grant-tables",  # any user, no password: a test server only
            "--skip-log-bin",
            "--innodb-buffer-pool-size=64M",
        ]
        if os.geteuid() == 0:
            args.append("--user=root")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.answers, timeout=30, interval=0.1)

    def answers(self) -> bool:
        import MySQLdb

        assert self.proc is not None and self.proc.poll() is None, (self.home / "error.log").read_text()[-2000:]
        try:
            MySQLdb.connect(host="127.0.0.1", port=self.port, user="root").close()
        except MySQLdb.OperationalError:
            return False
        return True

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)

    def query(self, sql: str, database: str = "") -> list[tuple]:
        import MySQLdb

        db = MySQLdb.connect(host="127.0.0.1", port=self.port, user="root", database=database, autocommit=True)
        try:
            cursor = db.cursor()
            cursor.execute(sql)
            return list(cursor.fetchall())
        finally:
            db.close()


@pytest.fixture
def own_mariadb() -> Iterator[OwnMariaDB]:
    if MARIADBD is None:
        pytest.skip("needs mariadbd installed")
    pytest.importorskip("MySQLdb")
    home = Path(tempfile.mkdtemp(prefix="tf-maria-", dir="/tmp"))  # short: socket paths are limited
    server = OwnMariaDB(home)
    try:
        server.start()
        yield server
    finally:
        server.stop(signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


def manage(env: dict[str, str], *args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


# It starts a MariaDB server of its own whatever the suite's database is, so it runs once per CI run:
# with the MariaDB leg.
@pytest.mark.skipif(
    not os.environ.get("DATABASE_URL", "").startswith("mysql"), reason="runs with the suite on MariaDB (DATABASE_URL)"
)
def test_a_mariadb_restart_under_load_loses_nothing_and_stops_no_process(
    own_mariadb: OwnMariaDB, spawn, process_env: dict[str, str], run_log: Path
) -> None:
    own_mariadb.query("CREATE DATABASE tf_restart CHARACTER SET utf8mb4")
    env = {"DATABASE_URL": f"mysql://root@127.0.0.1:{own_mariadb.port}/tf_restart"}
    manage({**process_env, **env}, "migrate", "-v0", "taskflow")
    # Half the tasks use the database from inside the handler, on the handler thread's connection.
    enqueue = (
        "import taskflow; taskflow.enqueue_many("
        "[{'task_type': 'test.uses_db', 'payload': {'sleep': 0.05}, 'max_retries': 10} for _ in range(400)]"
        " + [{'task_type': 'test.record', 'payload': {'sleep': 0.05}, 'max_retries': 10} for _ in range(400)])"
    )
    manage({**process_env, **env}, "shell", "-c", enqueue)
    types = ("--types", "test.uses_db,test.record", "--concurrency", "4")
    workers = [spawn("taskworker", *types, env=env) for _ in range(2)]
    watcher = spawn("taskwatch", env=env)

    def finished() -> int:
        return own_mariadb.query("SELECT COUNT(*) FROM taskflow_task WHERE status = 'success'", "tf_restart")[0][0]

    wait_until(lambda: finished() >= 100, timeout=60)
    own_mariadb.stop(signal.SIGTERM)  # mid-run: workers are claiming, running and reporting
    time.sleep(1.5)
    own_mariadb.start()
    restarted = time.time()

    try:
        wait_until(lambda: finished() == 800, timeout=90)
    except AssertionError as stuck:
        # What the unfinished rows hold says which mechanism failed to bring them back.
        columns = "id, status, attempts, lease_token, worker_id, started_at, lease_expires_at, run_after, schedule_log"
        rows = own_mariadb.query(f"SELECT {columns} FROM taskflow_task WHERE status <> 'success'", "tf_restart")
        raise AssertionError(f"{stuck}; restarted at {restarted:.3f}; {columns}: {rows}") from None

    procs = [*workers, watcher]
    assert [p.poll() for p in procs] == [None] * 3, [output(p)[-3000:] for p in procs if p.poll() is not None]
    runs = read_runs(run_log)
    # Every worker ran tasks again after the restart.
    worker_ids = {r[3] for r in runs}
    assert len(worker_ids) == 2
    assert all(any(r[3] == w and float(r[4]) > restarted for r in runs) for w in worker_ids)
    # Nothing ran twice, except attempts taken away (fenced) or failed by the outage, never a success.
    attempts: dict[str, set[int]] = defaultdict(set)
    for task_id, attempt, what, *_ in runs:
        if what in ("run", "start"):
            assert int(attempt) not in attempts[task_id], f"task {task_id} attempt {attempt} ran twice"
            attempts[task_id].add(int(attempt))
    rows = own_mariadb.query("SELECT id, attempts, schedule_log FROM taskflow_task", "tf_restart")
    assert len(rows) == 800 and len(attempts) == 800
    import json

    for task_id, final_attempt, log in rows:
        assert max(attempts[str(task_id)]) == final_attempt
        outcomes = {e["attempt"]: e["outcome"] for e in json.loads(log)}
        assert outcomes[final_attempt] == "success"
        assert [n for n, outcome in outcomes.items() if outcome == "success"] == [final_attempt]
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            assert proc.wait(timeout=30) == 0, output(proc)[-3000:]
