"""The remote worker against the real API (a live server on the test database): holding, running,
reporting, leases, outages, hand-backs and refused tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.db.models import F
from django.utils import timezone

import taskflow
from taskflow.engine import rescue
from taskflow.engine.remote import HOLD_ANSWER_GRACE
from taskflow.exceptions import InvalidTask, LeaseLost
from taskflow.models import Status, Task
from taskflow.runtime.remote import HttpChannel, RemoteAttempt, RemoteWorker, host_name
from taskflow.runtime.remote_client import ApiClient

from .conftest import REPO, read_runs, run_in_thread, wait_until
from .remote_support import CuttableProxy, api_token, require_liveness_beat

WORKER_PERMISSION = "hold_task"


@pytest.fixture
def token(transactional_db) -> str:  # noqa: ANN001
    return api_token("remote-worker", WORKER_PERMISSION)


@pytest.fixture
def api_url(live_server) -> str:  # noqa: ANN001
    return live_server.url + "/api/"


@pytest.fixture
def proxy(live_server) -> Iterator[CuttableProxy]:  # noqa: ANN001
    """The live server behind a line the test can cut."""
    parts = urlsplit(live_server.url)
    line = CuttableProxy(parts.hostname, parts.port)
    yield line
    line.close()


@pytest.fixture
def remote(
    api_url: str, token: str, run_log: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., RemoteWorker]]:
    """Start an in-process RemoteWorker on a thread; each is stopped at teardown."""
    monkeypatch.setenv("TASKFLOW_TEST_LOG", str(run_log))
    started = []

    def start(task_types: list[str], *, url: str | None = None, **options: object) -> RemoteWorker:
        options = {"poll_interval": 0.1, "beat_interval": 0.3, "grace": 5.0, "flush_timeout": 10.0, **options}
        worker = RemoteWorker(ApiClient(url or api_url, token, timeout=5), task_types, **options)  # type: ignore[arg-type]
        thread, raised = run_in_thread(worker)
        worker.thread, worker.raised = thread, raised  # type: ignore[attr-defined]
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.request_stop()
        worker.thread.join(timeout=30)  # type: ignore[attr-defined]
        assert not worker.thread.is_alive(), "remote worker did not stop within 30s"  # type: ignore[attr-defined]


def finished(*tasks: Task) -> Callable[[], bool]:
    ids = [t.pk for t in tasks]
    final = (Status.SUCCESS, Status.FAILED, Status.STOPPED)
    return lambda: Task.objects.filter(pk__in=ids, status__in=final).count() == len(ids)


def row(task: Task) -> Task:
    return Task.objects.get(pk=task.pk)


def held_attempt(client: ApiClient, task_type: str) -> RemoteAttempt:
    if client.credential is None:
        client.register("test-host", 1, [task_type], 1)
    asked = time.monotonic()
    [task], clock = client.hold([task_type], 1)
    return RemoteAttempt.from_json(task, asked, clock)


def take_away(task: Task) -> None:
    """What a rescue does to an attempt: back to pending with a new fencing token."""
    Task.objects.filter(pk=task.pk).update(status=Status.PENDING, lease_token=F("lease_token") + 1, worker_id="")


# -- importing -------------------------------------------------------------------------------------


def test_the_remote_worker_imports_no_django_orm_and_needs_no_settings() -> None:
    code = (
        "import sys, taskflow.remote, taskflow.runtime.remote, tests.taskapp.tasks\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('django.db', 'django.apps', 'rest_framework')))\n"
        "print(loaded)\n"
        "assert 'django.db.models' not in sys.modules, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- running tasks ----------------------------------------------------------------------------------


def test_a_remote_worker_runs_every_ending_like_the_local_worker(remote, run_log: Path) -> None:
    records = [taskflow.enqueue("test.record", {"n": n}) for n in range(10)]
    flaky = taskflow.enqueue("test.flaky", {"succeed_on": 2})
    staged = taskflow.enqueue("test.control", {"action": "stages"})
    snoozed = taskflow.enqueue("test.control", {"action": "snooze", "delay": 0})
    failed = taskflow.enqueue("test.control", {"action": "fail"})
    bad_result = taskflow.enqueue("test.misbehave", {"action": "result_not_json"})
    bad_signal = taskflow.enqueue("test.misbehave", {"action": "priority"})
    exhausted = taskflow.enqueue("test.fail", max_retries=1)
    everything = [*records, flaky, staged, snoozed, failed, bad_result, bad_signal, exhausted]

    remote(["test.record", "test.flaky", "test.control", "test.misbehave", "test.fail"], concurrency=4)
    wait_until(finished(*everything), timeout=60)

    for n, task in enumerate(records):
        assert (row(task).status, row(task).attempts, row(task).result) == (Status.SUCCESS, 1, {"n": n})
    assert (row(flaky).status, row(flaky).attempts, row(flaky).result) == (Status.SUCCESS, 2, {"attempt": 2})
    assert "not yet" in row(flaky).schedule_log[1]["error"]
    staged_row = row(staged)
    assert (staged_row.status, staged_row.stage) == (Status.SUCCESS, "second")
    assert staged_row.result == {"stage": "second", "context": {"from": "first"}, "checkpoint": None}
    snoozed_row = row(snoozed)
    # Snoozing did not use up an attempt; the checkpoint saved over HTTP before it was kept.
    assert (snoozed_row.status, snoozed_row.attempts, snoozed_row.result["checkpoint"]) == (
        Status.SUCCESS,
        1,
        "snoozed",
    )
    assert (row(failed).status, row(failed).attempts, row(failed).status_msg) == (
        Status.FAILED,
        1,
        "no point retrying",
    )
    assert row(bad_result).status == Status.FAILED and "result must be JSON-serialisable" in row(bad_result).status_msg
    assert row(bad_signal).status == Status.FAILED and "NextStage priority" in row(bad_signal).status_msg
    assert (row(exhausted).status, row(exhausted).attempts) == (Status.FAILED, 2)
    assert "boom on attempt 2" in row(exhausted).status_msg

    runs = Counter(r[0] for r in read_runs(run_log))
    assert runs[str(flaky.pk)] == 2 and runs[str(staged.pk)] == 2 and runs[str(snoozed.pk)] == 2
    assert all(runs[str(t.pk)] == 1 for t in records)


def test_a_burst_worker_drains_what_is_due_and_stops(remote) -> None:
    tasks = [taskflow.enqueue("test.record", {"n": n}) for n in range(30)]
    worker = remote(["test.record"], concurrency=4, burst=True)
    worker.thread.join(timeout=60)
    assert not worker.thread.is_alive() and worker.raised == []
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS, attempts=1).count() == 30
    assert worker.processed == 30


def test_a_result_the_server_will_not_store_fails_its_task_and_no_other(remote, settings) -> None:
    settings.TASKFLOW = {**settings.TASKFLOW, "MAX_PAYLOAD_BYTES": 2048}
    big = taskflow.enqueue("test.misbehave", {"size": 4000})
    small = taskflow.enqueue("test.misbehave", {"size": 100})
    remote(["test.misbehave"], concurrency=2)
    wait_until(finished(big, small), timeout=30)
    assert row(small).status == Status.SUCCESS
    assert (row(big).status, row(big).attempts) == (Status.FAILED, 1)
    assert "report refused by the server" in row(big).status_msg and "result" in row(big).status_msg


# -- leases -----------------------------------------------------------------------------------------


def test_a_checkpoint_over_http_is_saved_and_extends_the_deadline(api_url: str, token: str) -> None:
    task = taskflow.enqueue("test.record", {}, timeout=60)
    client = ApiClient(api_url, token)
    attempt = held_attempt(client, "test.record")
    before = row(task).lease_expires_at
    channel = HttpChannel(client, attempt)
    time.sleep(0.05)
    deadline = channel.heartbeat({"done": 3})
    saved = row(task)
    assert saved.checkpoint == {"done": 3} and saved.lease_expires_at > before
    assert abs((deadline - saved.lease_expires_at).total_seconds()) < 2
    channel.heartbeat()
    assert row(task).checkpoint == {"done": 3} and row(task).lease_expires_at >= saved.lease_expires_at


def test_a_checkpoint_the_server_refuses_raises_invalid_task_and_changes_nothing(api_url, token, settings) -> None:
    settings.TASKFLOW = {**settings.TASKFLOW, "MAX_PAYLOAD_BYTES": 2048}
    task = taskflow.enqueue("test.record", {})
    client = ApiClient(api_url, token)
    channel = HttpChannel(client, held_attempt(client, "test.record"))
    before = Task.objects.filter(pk=task.pk).values().get()
    with pytest.raises(InvalidTask, match="checkpoint"):
        channel.heartbeat({"data": "x" * 3000})
    with pytest.raises(InvalidTask, match="JSON-serialisable"):
        channel.heartbeat({"data": {1, 2}})
    assert Task.objects.filter(pk=task.pk).values().get() == before


def test_a_heartbeat_or_checkpoint_of_an_attempt_taken_away_raises_lease_lost(api_url: str, token: str) -> None:
    task = taskflow.enqueue("test.record", {})
    client = ApiClient(api_url, token)
    attempt = held_attempt(client, "test.record")
    channel = HttpChannel(client, attempt)
    take_away(task)
    before = Task.objects.filter(pk=task.pk).values().get()
    with pytest.raises(LeaseLost):
        channel.heartbeat()
    with pytest.raises(LeaseLost):
        channel.heartbeat({"late": True})
    assert channel.stop_requested
    assert Task.objects.filter(pk=task.pk).values().get() == before


def test_a_heartbeat_retries_through_an_outage_then_raises_lease_lost_when_the_lease_would_expire(
    proxy: CuttableProxy, token: str
) -> None:
    task = taskflow.enqueue("test.record", {})
    client = ApiClient(proxy.url + "/api/", token, timeout=2)
    attempt = held_attempt(client, "test.record")
    channel = HttpChannel(client, attempt)

    # Back within the lease: the heartbeat gets through and extends it.
    proxy.cut()
    attempt.local_deadline = time.monotonic() + 10
    restorer = __import__("threading").Timer(1.0, proxy.restore)
    restorer.start()
    started = time.monotonic()
    channel.heartbeat({"step": 1})
    assert time.monotonic() - started >= 0.9
    assert row(task).checkpoint == {"step": 1}

    # Still away when the lease would expire: LeaseLost, and nothing was written.
    proxy.cut()
    attempt.local_deadline = time.monotonic() + 1.5
    started = time.monotonic()
    with pytest.raises(LeaseLost, match="unreachable"):
        channel.heartbeat({"step": 2})
    assert 1.4 <= time.monotonic() - started < 5
    assert row(task).checkpoint == {"step": 1}


def test_a_running_attempt_stopped_by_an_operator_is_told_at_the_next_beat_and_its_report_is_refused(
    remote, run_log: Path, api_url: str, token: str
) -> None:
    require_liveness_beat(api_url, token)
    task = taskflow.enqueue("test.until_stopped", {"seconds": 10})
    worker = remote(["test.until_stopped"], concurrency=1)
    wait_until(lambda: read_runs(run_log), timeout=30)
    result = taskflow.terminate([task.pk], by="test-operator", reason="test")
    assert result.changed == 1
    wait_until(lambda: [r for r in read_runs(run_log) if r[2] == "noticed"], timeout=10)
    wait_until(lambda: worker.refused == 1, timeout=10)
    assert (row(task).status, row(task).result) == (Status.STOPPED, None)


# -- outages ----------------------------------------------------------------------------------------


def test_reports_finished_while_the_server_is_unreachable_are_kept_and_delivered(
    remote, proxy: CuttableProxy, run_log: Path
) -> None:
    tasks = [taskflow.enqueue("test.record", {"n": n, "sleep": 0.5}) for n in range(12)]
    worker = remote(["test.record"], url=proxy.url + "/api/", concurrency=4)
    wait_until(lambda: len([r for r in read_runs(run_log) if r[0] in {str(t.pk) for t in tasks}]) >= 4, timeout=30)
    proxy.cut()
    # The running attempts finish meanwhile; their reports cannot be sent and are kept.
    wait_until(lambda: worker.unreported >= 4, timeout=10)
    time.sleep(1.5)  # several failed tries
    assert worker.unreported >= 4 and worker.in_flight == 0
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS).count() <= 8
    proxy.restore()
    wait_until(finished(*tasks), timeout=60)
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS, attempts=1).count() == 12
    ids = {str(t.pk) for t in tasks}  # (a handler left running by an earlier test may log here too)
    assert Counter(r[0] for r in read_runs(run_log) if r[0] in ids) == Counter(dict.fromkeys(ids, 1))
    assert worker.refused == 0


# -- stopping ---------------------------------------------------------------------------------------


def test_a_stop_lets_running_tasks_finish_and_hands_unstarted_ones_back(
    api_url: str, token: str, run_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKFLOW_TEST_LOG", str(run_log))
    tasks = [taskflow.enqueue("test.sleep", {"seconds": 1.0}) for _ in range(4)]
    worker = RemoteWorker(ApiClient(api_url, token), ["test.sleep"], concurrency=4, grace=10, beat_interval=0.3)
    assert len(worker._claim().attempts) == 4
    # Held as one batch, but only one handler thread runs: three stay unstarted until the stop.
    worker.concurrency = 1
    thread, raised = run_in_thread(worker)
    wait_until(lambda: read_runs(run_log), timeout=30)
    worker.request_stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and raised == []
    statuses = Counter((row(t).status, row(t).attempts) for t in tasks)
    # What had started finished within the grace period; the rest went back unstarted, no attempt used.
    assert statuses == Counter({(Status.SUCCESS, 1): 1, (Status.PENDING, 0): 3})
    assert [r[2] for r in read_runs(run_log)] == ["start", "end"]
    assert worker.in_flight == 0 and worker.unreported == 0


def test_the_release_endpoint_hands_back_held_tasks_without_counting_an_attempt(api_url: str, token: str) -> None:
    tasks = [taskflow.enqueue("test.record", {"n": n}) for n in range(3)]
    worker = RemoteWorker(ApiClient(api_url, token), ["test.record"], concurrency=3)
    assert len(worker._claim().attempts) == 3
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.PROCESSING).count() == 3
    worker._hand_back_unstarted()
    worker.connector.report(list(worker._reports.values()), worker._settle)
    for task in tasks:
        assert (row(task).status, row(task).attempts, row(task).worker_id) == (Status.PENDING, 0, "")
    assert worker.in_flight == 0


# -- the command --------------------------------------------------------------------------------------


def run_command(api_url: str, token: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    command = [
        sys.executable,
        "-m",
        "taskflow.remote",
        "--url",
        api_url,
        "--token-file",
        str(token_file),
        "--handlers",
        "tests.taskapp.tasks",
        *args,
    ]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_the_command_drains_in_burst_mode(api_url: str, token: str, tmp_path: Path) -> None:
    tasks = [taskflow.enqueue("test.record", {"n": n}) for n in range(5)]
    done = run_command(api_url, token, tmp_path, "--types", "test.record", "--burst", "--poll-interval", "0.1")
    assert done.returncode == 0, done.stderr
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS).count() == 5


@pytest.mark.parametrize(
    ("codenames", "status"),
    [(None, 401), ((), 403), (("add_task", "view_task"), 403)],
    ids=["bad-token", "none", "producer"],
)
def test_a_token_the_server_refuses_stops_the_command_with_one_line(
    api_url: str,
    transactional_db,
    tmp_path: Path,
    codenames,
    status: int,  # noqa: ANN001
) -> None:
    key = "0" * 40 if codenames is None else api_token("someone", *codenames)
    task = taskflow.enqueue("test.record", {})
    done = run_command(api_url, key, tmp_path, "--types", "test.record")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "taskflow.remote:" in line]
    assert errors == [
        f"taskflow.remote: the server refused the token ({status}): check the token and its hold_task permission"
    ]
    assert (row(task).status, row(task).attempts) == (Status.PENDING, 0)


def test_bad_options_exit_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        (["--handlers", "no.such.module"], "cannot import handlers module 'no.such.module'"),
        (["--handlers", "tests.taskapp.tasks", "--types", "nobody.handles"], "no handler registered"),
        (["--handlers", "tests.taskapp.tasks", "--token-file", str(empty)], "must hold the token alone"),
    ]
    token_file = tmp_path / "token"
    token_file.write_text("abc")
    for args, message in cases:
        base = ["--url", "http://127.0.0.1:9/api/", "--token-file", str(token_file)]
        done = subprocess.run(
            [sys.executable, "-m", "taskflow.remote", *base, *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_a_beat_hands_back_tasks_whose_hold_answer_was_lost(api_url: str, token: str) -> None:
    require_liveness_beat(api_url, token)
    tasks = [taskflow.enqueue("test.record", {"n": n}) for n in range(3)]
    client = ApiClient(api_url, token)
    client.register("lost-host", 1, ["test.record"], 1)
    # Claimed for this worker, but the answer never reached it (the server died before replying).
    client.hold(["test.record"], 3)
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.PROCESSING).count() == 3
    worker = RemoteWorker(client, ["test.record"], concurrency=1)
    # Too soon: the server leaves a hold that may still be answering alone.
    worker.connector.between_claims(worker.held_attempts())
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.PROCESSING).count() == 3
    time.sleep(HOLD_ANSWER_GRACE + 0.2)
    worker.connector._last_beat = 0.0
    worker.connector.between_claims(worker.held_attempts())
    for task in tasks:
        assert (row(task).status, row(task).attempts, row(task).worker_id) == (Status.PENDING, 0, "")


def test_a_report_batch_over_the_servers_request_limit_is_split_until_it_fits(remote, settings) -> None:
    settings.TASKFLOW = {**settings.TASKFLOW, "MAX_REQUEST_BYTES": 4096}
    # Each result fits in a request alone, four together do not (413): they are sent in halves.
    tasks = [taskflow.enqueue("test.misbehave", {"size": 1500}) for _ in range(4)]
    too_big = taskflow.enqueue("test.misbehave", {"size": 5000})  # not even alone: its task fails
    remote(["test.misbehave"], concurrency=5)
    wait_until(finished(*tasks, too_big), timeout=30)
    for task in tasks:
        assert (row(task).status, len(row(task).result["data"])) == (Status.SUCCESS, 1500 - 12)
    assert (row(too_big).status, row(too_big).attempts) == (Status.FAILED, 1)
    assert "report refused by the server" in row(too_big).status_msg


def test_a_liveness_beat_moves_no_deadline_so_a_stuck_remote_handler_still_times_out(api_url: str, token: str) -> None:
    task = taskflow.enqueue("test.record", {}, timeout=60)
    client = ApiClient(api_url, token)
    worker = RemoteWorker(client, ["test.record"], concurrency=1)
    assert len(worker._claim().attempts) == 1
    assert worker.worker_id.startswith(f"{host_name()}:{os.getpid()}:")
    deadline = row(task).lease_expires_at
    time.sleep(1.1)
    worker.connector.between_claims(worker.held_attempts())
    assert row(task).status == Status.PROCESSING and row(task).worker_id == worker.worker_id
    # Only the handler's own heartbeat or checkpoint extends it, as for a local worker.
    assert row(task).lease_expires_at == deadline


def test_a_handler_past_its_deadline_loses_its_attempt_and_its_thread_is_replaced(remote, run_log: Path) -> None:
    stuck = taskflow.enqueue("test.sleep", {"seconds": 5}, timeout=3, max_retries=0)
    worker = remote(["test.sleep"], concurrency=1)
    wait_until(lambda: read_runs(run_log), timeout=30)
    # No heartbeat: past its deadline the attempt ends as a failed one (no retries left: failed).
    wait_until(lambda: row(stuck).status == Status.FAILED, timeout=15)
    assert row(stuck).attempts == 1 and "ran past its deadline" in row(stuck).status_msg
    # Its thread no longer counts: the next task runs while the stuck handler still sleeps.
    quick = taskflow.enqueue("test.sleep", {"seconds": 0})
    wait_until(finished(quick), timeout=15)
    assert [r[2] for r in read_runs(run_log) if r[0] == str(stuck.pk)] == ["start"]
    # When the stuck handler finally returns, its result is dropped: the task stays as it ended.
    wait_until(lambda: [r for r in read_runs(run_log) if r[0] == str(stuck.pk) and r[2] == "end"], timeout=15)
    time.sleep(0.5)
    assert (row(stuck).status, row(stuck).result, len(row(stuck).schedule_log)) == (Status.FAILED, None, 1)
    assert worker.in_flight == 0 and worker.unreported == 0


def test_a_worker_whose_credential_is_refused_registers_again_and_its_old_attempt_is_rescued(
    remote, run_log: Path, settings
) -> None:
    """A new SECRET_KEY revokes every worker and attempt key: the worker carries on under a new id."""
    task = taskflow.enqueue("test.sleep", {"seconds": 1.5}, max_retries=3)
    worker = remote(["test.sleep"], concurrency=1)
    wait_until(lambda: read_runs(run_log), timeout=30)
    first_id = worker.worker_id
    settings.SECRET_KEY = "a-rotated-secret-key-for-this-test-only-0123456789"
    wait_until(lambda: worker.worker_id not in ("", first_id), timeout=15)
    # The old attempt's report is refused (not this worker's any more) and dropped, not retried.
    wait_until(lambda: worker.refused == 1, timeout=15)
    assert (row(task).status, row(task).worker_id, row(task).result) == (Status.PROCESSING, first_id, None)
    # The old id no longer beats: taskwatch's rescue takes the attempt back, and the new id runs it.
    wait_until(lambda: rescue.rescue_dead_workers() == 1, timeout=15)
    Task.objects.filter(pk=task.pk).update(run_after=timezone.now())
    wait_until(finished(task), timeout=30)
    got = row(task)
    assert (got.status, got.attempts, got.result, got.worker_id) == (
        Status.SUCCESS,
        2,
        {"slept": 1.5},
        worker.worker_id,
    )
    assert worker.raised == [] and worker.thread.is_alive()
