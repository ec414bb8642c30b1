"""Shared fixtures: a clean Redis namespace, and real worker/watcher processes on the test database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client

from taskflow.api.authentication import forget_credentials
from taskflow.engine import remote
from taskflow.engine.configs import configs
from taskflow.engine.redis import get_redis

REPO = Path(__file__).resolve().parent.parent
# The plugin an installed taskflow registers by its entry point (same name: never loaded twice).
pytest_plugins = ["taskflow.testing"]


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    """Each test starts with no cached ScheduleCfg, no remembered beats, cached tokens or taskflow keys in Redis.

    (A test's rows are rolled back behind the caches' backs: a remote worker's remembered beat
    would leave it unregistered, a kept token would outlive its user.)
    """
    configs.clear()
    remote.forget_beats()
    forget_credentials()
    client = get_redis()
    if client is not None:
        for k in client.scan_iter("taskflow:*"):
            client.delete(k)
    yield
    configs.clear()


@pytest.fixture
def redis_client():  # noqa: ANN201
    client = get_redis()
    if client is None:
        pytest.skip("needs Redis (set REDIS_URL)")
    return client


def database_url() -> str:
    """A DATABASE_URL for the database the tests are using (the test database)."""
    s = connection.settings_dict
    vendor = connection.vendor
    if vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    scheme = {"mysql": "mysql", "postgresql": "postgres"}[vendor]
    auth = quote(s["USER"] or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    return f"{scheme}://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or ''}/{s['NAME']}"


@pytest.fixture
def run_log(tmp_path: Path) -> Path:
    """The file test handlers append one line per run to (see tests/taskapp/tasks.py)."""
    return tmp_path / "runs.log"


def read_runs(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def peak_overlap(run_log: Path) -> int:
    """The most handlers running at one instant, by the run log's start and end lines."""
    events = sorted((float(r[4]), 1 if r[2] == "start" else -1) for r in read_runs(run_log) if r[2] in ("start", "end"))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


@pytest.fixture
def process_env(transactional_db, run_log: Path) -> dict[str, str]:  # noqa: ANN001
    """Environment for child processes: same test database, Redis and handlers as this test."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DJANGO_SECRET_KEY="taskflow-tests-only",
        DATABASE_URL=database_url(),
        TASKFLOW_TEST_LOG=str(run_log),
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def spawn(process_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `manage.py <args>` as a real process; every process still running is killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(tmp_path / f"proc-{len(procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "manage.py"), *args],
            cwd=REPO,
            env={**process_env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


def exit_status(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """Wait for a process started by `spawn`; if it will not exit, fail with its log and its threads' stacks."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # faulthandler writes every thread's stack to the log (tests/settings.py)
        time.sleep(1.0)
        proc.kill()
        proc.wait(timeout=10)
        log = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
        raise AssertionError(f"still running {timeout:.0f}s later: {proc.args}\n{log[-20000:]}") from None


def history_tables() -> list[str]:
    """The tables tasks were rolled into (they are not Django's: a flush between tests leaves them)."""
    from taskflow.engine import sql

    prefix = sql.task_table() + "_"
    with connection.cursor() as cursor:
        return [t for t in connection.introspection.table_names(cursor) if t.startswith(prefix)]


def drop_history_tables() -> None:
    from taskflow.engine import sql

    with connection.cursor() as cursor:
        for table in history_tables():
            cursor.execute(f"DROP TABLE {sql.quote(table)}")


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05) -> object:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def run_in_thread(worker) -> tuple[threading.Thread, list[BaseException]]:  # noqa: ANN001
    """Run `worker.run()` on a daemon thread; what it raises is appended to the returned list."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="test-worker", daemon=True)
    thread.start()
    return thread, raised


@pytest.fixture
def start_worker(transactional_db, run_log: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., object]]:
    """Run an in-process Worker on a thread (handlers log to `run_log`); each is stopped at teardown."""
    from taskflow.runtime.worker import Worker

    monkeypatch.setenv("TASKFLOW_TEST_LOG", str(run_log))
    started: list[tuple[Worker, threading.Thread]] = []

    def start(task_types: list[str], **options: object) -> Worker:
        worker = Worker(task_types, **options)  # type: ignore[arg-type]
        thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.request_stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "worker did not stop within 30s"


def staff(name: str, *codenames: str) -> Client:
    """A logged-in staff member holding exactly these taskflow permissions (the console's tests)."""
    user = User.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="taskflow", codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client
