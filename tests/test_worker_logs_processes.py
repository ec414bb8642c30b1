"""What real worker processes print: the start-up banner (no passwords) and one line per task outcome,
in a project with no LOGGING setting; `-l`/`-v` and `--log-format json`; and a project's LOGGING winning."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.db import connection

import taskflow
from taskflow.runtime.logs import redact_url

from .conftest import REPO
from .remote_support import api_token

pytestmark = pytest.mark.processes

DB_SECRET = "db-pw-hunter2"
REDIS_SECRET = "redis-pw-swordfish"

# A project like `django-admin startproject` makes: taskflow's test settings without LOGGING.
NO_LOGGING_SETTINGS = """
import os
from tests.settings import *  # noqa: F403

del LOGGING  # noqa: F821
if os.environ.get("TEST_REDIS_LOCATION"):
    CACHES["default"]["LOCATION"] = os.environ["TEST_REDIS_LOCATION"]  # noqa: F405
if os.environ.get("TEST_DB_PASSWORD"):
    DATABASES["default"]["PASSWORD"] = os.environ["TEST_DB_PASSWORD"]  # noqa: F405
"""


class RedisAuthProxy:
    """Forwards to the tests' Redis, taking a connection's password itself (AUTH, or HELLO's AUTH part): so
    a worker can use a Redis URL with a password on a server that has none. Records the passwords given."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.passwords: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError), client, socket.create_connection(self.target) as upstream:
            buffer = b""
            while (command := _resp_command(buffer)) is None:
                data = client.recv(65536)
                if not data:
                    return
                buffer += data
            words, used = command
            name = words[0].upper() if words else b""
            if name == b"AUTH":
                self.passwords.append(words[-1].decode())
                client.sendall(b"+OK\r\n")
                buffer = buffer[used:]
            elif name == b"HELLO" and b"AUTH" in (w.upper() for w in words):  # redis-py's RESP3 hand-shake
                at = [w.upper() for w in words].index(b"AUTH")
                self.passwords.append(words[at + 2].decode())
                buffer = _resp([*words[:at], *words[at + 3 :]]) + buffer[used:]
            upstream.sendall(buffer)
            threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
            _pipe(client, upstream)


def _resp_command(buffer: bytes) -> tuple[list[bytes], int] | None:
    """The first RESP array of bulk strings in `buffer` and its length, or None if not all there yet."""
    lines = buffer.split(b"\r\n")
    if len(lines) < 2 or not lines[0].startswith(b"*"):
        return None
    count, words, i = int(lines[0][1:]), [], 1
    while len(words) < count:
        if i + 1 >= len(lines):
            return None
        words.append(lines[i + 1])
        i += 2
    used = sum(len(line) + 2 for line in lines[:i])
    return (words, used) if used <= len(buffer) else None


def _resp(words: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def new_project(spawn, tmp_path: Path) -> Iterator[tuple[Callable[..., subprocess.Popen], dict[str, str]]]:
    """`spawn` for a project with no LOGGING, whose database URL (and Redis URL, if any) carry a password."""
    (tmp_path / "nolog_settings.py").write_text(NO_LOGGING_SETTINGS)
    env = {"DJANGO_SETTINGS_MODULE": "nolog_settings", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    secrets: dict[str, str] = {}
    if connection.vendor in ("sqlite", "postgresql"):  # SQLite ignores a password; the tests' PostgreSQL trusts
        env["TEST_DB_PASSWORD"] = secrets["database"] = DB_SECRET
    proxy = None
    if os.environ.get("REDIS_URL"):
        redis = urlsplit(os.environ["REDIS_URL"])
        proxy = RedisAuthProxy((redis.hostname or "127.0.0.1", redis.port or 6379))
        env["TEST_REDIS_LOCATION"] = f"redis://:{REDIS_SECRET}@127.0.0.1:{proxy.port}{redis.path}"
        secrets["redis"] = REDIS_SECRET

    def start(*args: str) -> subprocess.Popen:
        return spawn(*args, env=env)

    start.proxy = proxy  # type: ignore[attr-defined]
    yield start, secrets
    if proxy is not None:
        proxy.close()


def finished(proc: subprocess.Popen, timeout: float = 120) -> str:
    code = proc.wait(timeout=timeout)
    out = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    assert code == 0, out
    return out


def task_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " taskflow.tasks " in line]


def test_a_worker_in_a_project_without_logging_prints_its_banner_and_a_line_per_task(new_project) -> None:
    start, secrets = new_project
    ok = taskflow.enqueue("test.record", {"n": 1})
    bad = taskflow.enqueue("test.fail", {}, max_retries=0)
    out = finished(start("taskworker", "--burst", "--types", "test.record,test.fail", "--concurrency", "2"))

    [banner] = [line for line in out.splitlines() if " starting: " in line]
    assert " INFO taskflow.worker taskflow " in banner
    assert f"database {connection.vendor} " in banner and str(connection.settings_dict["NAME"]) in banner
    assert "concurrency 2 (burst), types test.record,test.fail" in banner
    if "redis" in secrets:
        assert f"redis redis://:***@127.0.0.1:{start.proxy.port}/" in banner
        assert REDIS_SECRET in start.proxy.passwords  # the worker really used the URL with the password
    else:
        assert "redis none" in banner
    for secret in secrets.values():
        assert secret not in out

    lines = task_lines(out)
    assert len(lines) == 2, out
    [success] = [line for line in lines if f"[{ok.pk}]" in line]
    [failure] = [line for line in lines if f"[{bad.pk}]" in line]
    assert f"task test.record[{ok.pk}] attempt 1 took " in success and success.endswith(" ms: success")
    assert failure.endswith(": failed: RuntimeError: boom on attempt 1"), failure
    assert "Traceback" not in out  # the traceback only at DEBUG (or in the JSON field)


def test_a_retry_is_logged_with_its_time_and_debug_adds_the_traceback(new_project) -> None:
    start, _ = new_project
    flaky = taskflow.enqueue("test.flaky", {"succeed_on": 2})
    out = finished(start("taskworker", "--burst", "--types", "test.flaky", "-v", "2"))
    [line] = [line for line in out.splitlines() if f"[{flaky.pk}] attempt 1" in line]
    assert ": retry at 20" in line and "(in " in line and line.endswith(": ValueError: not yet")
    assert "Traceback (most recent call last):" in out and 'raise ValueError("not yet")' in out


def test_warning_level_prints_no_line_per_task(new_project) -> None:
    start, _ = new_project
    for quiet in (["-l", "WARNING"], ["--loglevel", "warning"], ["-v", "0"]):
        taskflow.enqueue("test.record", {"n": 1})
        taskflow.enqueue("test.fail", {}, max_retries=0)
        out = finished(start("taskworker", "--burst", "--types", "test.record,test.fail", *quiet))
        assert task_lines(out) == [] and "taskflow.tasks" not in out, (quiet, out)
        assert " starting: " not in out  # the banner is an INFO line too


def test_json_lines_carry_the_task_fields(new_project) -> None:
    start, secrets = new_project
    ok = taskflow.enqueue("test.record", {"n": 1})
    bad = taskflow.enqueue("test.fail", {}, max_retries=0, trace_id="trace-of-bad")
    out = finished(start("taskworker", "--burst", "--types", "test.record,test.fail", "--log-format", "json"))

    entries = [json.loads(line) for line in out.splitlines()]  # every line is one JSON object
    for entry in entries:
        assert {"time", "level", "logger", "message", "task_id", "trace_id"} <= set(entry)
    [banner] = [e for e in entries if e["logger"] == "taskflow.worker" and "starting" in e["message"]]
    assert banner["types"] == ["test.record", "test.fail"] and banner["concurrency"] == 8
    assert banner["database"].startswith(connection.vendor)
    for secret in secrets.values():
        assert secret not in out
    by_id = {e["task_id"]: e for e in entries if e["logger"] == "taskflow.tasks"}
    assert set(by_id) == {str(ok.pk), str(bad.pk)}
    success, failure = by_id[str(ok.pk)], by_id[str(bad.pk)]
    assert (success["level"], success["task_type"], success["attempt"], success["outcome"]) == (
        "INFO",
        "test.record",
        1,
        "success",
    )
    assert isinstance(success["duration_ms"], int) and success["trace_id"] == ok.trace_id
    assert (failure["outcome"], failure["error"], failure["trace_id"]) == (
        "failed",
        "RuntimeError: boom on attempt 1",
        "trace-of-bad",
    )
    assert failure["traceback"].startswith("Traceback (most recent call last):")


def test_a_project_logging_config_wins(spawn) -> None:
    """tests.settings keeps the example project's LOGGING (its format names task= and trace=)."""
    ok = taskflow.enqueue("test.record", {"n": 1})
    proc = spawn("taskworker", "--burst", "--types", "test.record", "--log-format", "json")
    out = finished(proc)
    assert "{" not in out  # the project's format, not JSON
    [line] = task_lines(out)
    assert f" INFO taskflow.tasks task={ok.pk} trace={ok.trace_id} task test.record[{ok.pk}] attempt 1 took " in line
    # Its level still follows an explicit -v/-l: the project's handler, taskflow's level.
    taskflow.enqueue("test.record", {"n": 2})
    out = finished(spawn("taskworker", "--burst", "--types", "test.record", "-v", "0"))
    assert task_lines(out) == [] and " starting: " not in out


def test_taskwatch_prints_its_banner(new_project) -> None:
    start, secrets = new_project
    out = finished(start("taskwatch", "--once"))
    [banner] = [line for line in out.splitlines() if " starting: " in line]
    assert " INFO taskflow.watch taskflow " in banner and " taskwatch " in banner
    assert f"database {connection.vendor} " in banner and "one pass" in banner
    assert ("redis redis://:***@" if "redis" in secrets else "redis none") in banner
    for secret in secrets.values():
        assert secret not in out
    assert "one pass done" in out


# -- the remote worker ------------------------------------------------------------------------------------


def run_remote(url: str, token: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    command = [sys.executable, "-m", "taskflow.remote", "--url", url, "--token-file", str(token_file)]
    command += ["--handlers", "tests.taskapp.tasks", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_remote_worker_prints_its_banner_and_a_line_per_task(live_server, tmp_path: Path) -> None:
    token = api_token("remote-worker", "hold_task")
    ok = taskflow.enqueue("test.record", {"n": 1})
    bad = taskflow.enqueue("test.fail", {}, max_retries=0)
    flaky = taskflow.enqueue("test.flaky", {"succeed_on": 2}, max_retries=3)
    args = ["--types", "test.record,test.fail,test.flaky", "--concurrency", "2", "--burst", "--poll-interval", "0.1"]
    done = run_remote(live_server.url + "/api/", token, tmp_path, *args)
    assert done.returncode == 0, done.stderr
    out = done.stderr

    [banner] = [line for line in out.splitlines() if " starting: " in line]
    assert " INFO taskflow.remote taskflow " in banner
    assert f"remote worker starting: api {live_server.url}/api/, host " in banner
    assert "concurrency 2 (burst), types test.record,test.fail,test.flaky" in banner
    lines = task_lines(out)
    assert f"task test.record[{ok.pk}] attempt 1 took " in "\n".join(lines)
    [success] = [line for line in lines if f"[{ok.pk}]" in line]
    [failure] = [line for line in lines if f"[{bad.pk}]" in line]
    [retry] = [line for line in lines if f"[{flaky.pk}] attempt 1" in line]
    assert success.endswith(" ms: success")
    assert failure.endswith(": failed: RuntimeError: boom on attempt 1"), failure
    assert retry.endswith(": retry (the server's policy decides when): ValueError: not yet"), retry

    # JSON lines, and -l WARNING turns the per-task lines off.
    second = taskflow.enqueue("test.record", {"n": 2})
    done = run_remote(live_server.url + "/api/", token, tmp_path, *args, "--log-format", "json")
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    [entry] = [e for e in entries if e["task_id"] == str(second.pk)]
    assert (entry["logger"], entry["task_type"], entry["attempt"], entry["outcome"]) == (
        "taskflow.tasks",
        "test.record",
        1,
        "success",
    )
    taskflow.enqueue("test.record", {"n": 3})
    done = run_remote(live_server.url + "/api/", token, tmp_path, *args, "-l", "WARNING")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_remote_banner_shows_no_credentials_of_the_api_url(live_server, tmp_path: Path) -> None:
    parts = urlsplit(live_server.url)
    url = f"{parts.scheme}://operator:{DB_SECRET}@{parts.netloc}/api/"
    done = run_remote(url, "0" * 40, tmp_path, "--types", "test.record")
    assert done.returncode == 2  # the server refuses the credentials
    assert f"api {parts.scheme}://operator:***@{parts.netloc}/api/" in done.stderr
    assert DB_SECRET not in done.stderr


def test_redact_url_removes_passwords_and_keeps_the_rest() -> None:
    assert redact_url("redis://:pw@h:6379/13") == "redis://:***@h:6379/13"
    assert redact_url("redis://user:pw@h/0?ssl_cert_reqs=none&password=x") == (
        "redis://user:***@h/0?ssl_cert_reqs=none&password=***"
    )
    assert redact_url("unix:///run/redis.sock?db=2") == "unix:///run/redis.sock?db=2"
    assert redact_url("http://u@h/api/") == "http://u@h/api/"
