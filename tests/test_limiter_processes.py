"""Concurrency limits held by real worker processes, sampled from outside; and a Redis outage mid-run."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count
from django.utils import timezone

import taskflow
from taskflow.engine import finishing, operations
from taskflow.engine.configs import configs
from taskflow.engine.limiter import GLOBAL, held_slots, reconcile_counters, slots_key
from taskflow.engine.redis import get_redis
from taskflow.models import ScheduleCfg, Status, Task
from taskflow.runtime import worker as worker_module

from .conftest import exit_status, read_runs, wait_until

pytestmark = pytest.mark.processes

WORKERS, CONCURRENCY = 4, 4


class Repeating(threading.Thread):
    """Calls `action` every `interval` seconds on a thread of its own until stopped."""

    def __init__(self, action: Callable[[], object], interval: float, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.action, self.interval, self.calls = action, interval, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.action()
                self.calls += 1
                self._stop_event.wait(self.interval)
        finally:
            connection.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


class Sampler(Repeating):
    """Counts processing rows by type every `interval` seconds, keeping the peaks."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(self.sample, interval, "processing-sampler")
        self.peak: dict[str, int] = defaultdict(int)
        self.peak_total = 0

    @property
    def samples(self) -> int:
        return self.calls

    def sample(self) -> None:
        rows = Task.objects.filter(status=Status.PROCESSING).values_list("task_type").annotate(n=Count("id")).order_by()
        counts = dict(rows)
        for task_type, n in counts.items():
            self.peak[task_type] = max(self.peak[task_type], n)
        self.peak_total = max(self.peak_total, sum(counts.values()))


@pytest.fixture
def sampler(transactional_db) -> Iterator[Sampler]:  # noqa: ANN001
    running = Sampler()
    running.start()
    yield running
    running.stop()


@pytest.fixture(params=["redis", "db"])
def limiter_mode(request: pytest.FixtureRequest) -> dict[str, str]:
    """Worker environment for the Redis limiter, or for the exact database limit (no Redis at all)."""
    if request.param == "redis":
        if get_redis() is None:
            pytest.skip("needs Redis (set REDIS_URL)")
        return {}
    return {"REDIS_URL": ""}


class Workers:
    """Worker processes of one test, stopped gracefully (and required to exit cleanly)."""

    def __init__(self, spawn: Callable[..., subprocess.Popen]) -> None:
        self.spawn = spawn
        self.procs: list[subprocess.Popen] = []

    def start(self, types: str, env: dict[str, str], count: int = WORKERS) -> list[subprocess.Popen]:
        args = ("taskworker", "--types", types, "--concurrency", str(CONCURRENCY))
        procs = [self.spawn(*args, env=env) for _ in range(count)]
        self.procs.extend(procs)
        return procs

    def stop(self) -> None:
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            assert exit_status(proc) == 0, Path(proc.log_path).read_text()  # type: ignore[attr-defined]


@pytest.fixture
def workers(spawn: Callable[..., subprocess.Popen]) -> Iterator[Workers]:
    started = Workers(spawn)
    yield started
    started.stop()


def set_limit(task_type: str, limit: int) -> None:
    configs.get(task_type)  # the row, created with defaults
    ScheduleCfg.objects.filter(pk=task_type).update(concurrency_limit=limit)
    configs.clear()  # for workers in this process


def statuses(task_type: str) -> dict[str, int]:
    return dict(Task.objects.filter(task_type=task_type).values_list("status").annotate(n=Count("id")).order_by())


def all_succeeded(task_type: str, count: int) -> bool:
    return statuses(task_type) == {Status.SUCCESS: count}


def settings_module(tmp_path: Path, **taskflow_settings: object) -> dict[str, str]:
    """Environment that runs child processes on tests.settings with TASKFLOW entries overridden."""
    package = tmp_path / "childsettings"
    package.mkdir(exist_ok=True)
    (package / "limiter_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        "from tests.settings import TASKFLOW\n"
        f"TASKFLOW = {{**TASKFLOW, **{taskflow_settings!r}}}\n"
    )
    return {"PYTHONPATH": str(package), "DJANGO_SETTINGS_MODULE": "limiter_settings"}


def report(what: str, sampler: Sampler, limit: int, observed: int, started: float) -> None:
    print(
        f"\n{what}: max concurrent {observed} (limit {limit}); "
        f"{sampler.samples} samples every {sampler.interval * 1000:.0f} ms over {time.monotonic() - started:.1f}s; "
        f"peaks by type {dict(sampler.peak)}"
    )


def test_type_limit_holds_across_worker_processes(workers, sampler, limiter_mode):
    set_limit("test.sleep", 3)
    taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 0.3}} for _ in range(24)])
    taskflow.enqueue_many([{"task_type": "test.record", "payload": {"sleep": 0.3}} for _ in range(24)])
    started = time.monotonic()
    workers.start("test.sleep,test.record", limiter_mode)
    wait_until(lambda: all_succeeded("test.sleep", 24) and all_succeeded("test.record", 24), timeout=180)
    sampler.stop()
    report(f"type limit ({'redis' if not limiter_mode else 'db'})", sampler, 3, sampler.peak["test.sleep"], started)
    assert sampler.peak["test.sleep"] == 3
    assert sampler.peak["test.record"] > 3  # the unlimited type is not held to it
    if not limiter_mode:
        workers.stop()  # idle workers still take and give back slots as they poll
        assert held_slots("test.sleep") == 0
        assert reconcile_counters() == {"test.sleep": 0}


def test_global_limit_holds_across_worker_processes(workers, sampler, limiter_mode, tmp_path, settings):
    settings.TASKFLOW = {**settings.TASKFLOW, "GLOBAL_CONCURRENCY_LIMIT": 3}
    taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 0.3}} for _ in range(12)])
    taskflow.enqueue_many([{"task_type": "test.record", "payload": {"sleep": 0.3}} for _ in range(12)])
    started = time.monotonic()
    workers.start("test.sleep,test.record", {**limiter_mode, **settings_module(tmp_path, GLOBAL_CONCURRENCY_LIMIT=3)})
    wait_until(lambda: all_succeeded("test.sleep", 12) and all_succeeded("test.record", 12), timeout=180)
    sampler.stop()
    report(f"global limit ({'redis' if not limiter_mode else 'db'})", sampler, 3, sampler.peak_total, started)
    assert sampler.peak_total == 3
    assert sampler.peak["test.sleep"] >= 1 and sampler.peak["test.record"] >= 1
    if not limiter_mode:
        workers.stop()
        assert held_slots(GLOBAL) == 0
        assert reconcile_counters() == {GLOBAL: 0}


# -- Redis outage ----------------------------------------------------------------------------------


class OwnRedis:
    """A redis-server of this test's own, which the test can kill and restart on the same port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._accepting, timeout=20)
        assert self.proc.poll() is None, f"redis-server could not start on port {self.port}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def _accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def own_redis(settings) -> Iterator[OwnRedis]:  # noqa: ANN001
    """A private Redis that this test process uses too (for enqueue wake-ups, counters and reconciling)."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    server = OwnRedis(free_port())  # not a fixed one: other runs of this suite may be going on
    server.start()
    settings.CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
        }
    }
    settings.TASKFLOW = {**settings.TASKFLOW, "REDIS_ALIAS": "default"}
    yield server
    if server.proc is not None:
        server.kill()


def logged(procs: list[subprocess.Popen], text: str) -> list[bool]:
    return [text in Path(proc.log_path).read_text() for proc in procs]  # type: ignore[attr-defined]


def test_redis_outage_stops_limited_types_only_and_recovers(own_redis, workers, sampler):
    set_limit("test.sleep", 2)
    taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 8}} for _ in range(4)])
    started = time.monotonic()
    procs = workers.start("test.sleep,test.record", {"REDIS_URL": own_redis.url}, count=3)
    wait_until(lambda: statuses("test.sleep").get(Status.PROCESSING) == 2, timeout=60)

    own_redis.kill()  # both slots are held, so no grant can be on its way to a claim
    killed = time.monotonic()
    wait_until(lambda: all(logged(procs, "concurrency limiter unavailable")), timeout=30)
    taskflow.enqueue_many([{"task_type": "test.record", "payload": {"sleep": 0.05}} for _ in range(12)])
    wait_until(lambda: all_succeeded("test.record", 12), timeout=60)
    outage = time.monotonic() - killed
    # Unlimited work went on; the limited type claimed nothing, and its first two still run.
    assert statuses("test.sleep") == {Status.PROCESSING: 2, Status.PENDING: 2}, f"after {outage:.1f}s outage"

    own_redis.start()  # empty: the counters must be rebuilt from the database, not from zero
    wait_until(lambda: any(logged(procs, "rebuilt from the database: {'test.sleep': 2}")), timeout=30)
    wait_until(lambda: all_succeeded("test.sleep", 4), timeout=120)
    sampler.stop()
    report(f"redis outage ({outage:.1f}s, restarted empty)", sampler, 2, sampler.peak["test.sleep"], started)
    assert sampler.peak["test.sleep"] == 2
    assert sampler.peak["test.record"] > 2
    workers.stop()
    assert held_slots("test.sleep") == 0  # no slot leaked or freed twice
    # As if the first two had been held past their end: reconciliation frees exactly those.
    first_two = Task.objects.filter(task_type="test.sleep").order_by("id")[:2].values_list("id", "lease_token")
    get_redis().zadd(slots_key("test.sleep"), {f"{i}:{token - 1}": "+inf" for i, token in first_two})
    assert held_slots("test.sleep") == 2
    assert reconcile_counters() == {"test.sleep": 0}


# -- steady load ------------------------------------------------------------------------------------


def test_limit_of_five_holds_for_800_short_tasks_with_reconciliation_every_second(
    spawn, sampler, limiter_mode, tmp_path
):
    set_limit("test.sleep", 5)
    taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 0.05}} for _ in range(800)])
    started = time.monotonic()
    env = {**limiter_mode, **settings_module(tmp_path, RECONCILE_INTERVAL=1.0, WATCH_INTERVAL=0.5)}
    spawn("taskwatch", env=env)
    steady = Workers(spawn)
    for _ in range(4):
        steady.procs.append(spawn("taskworker", "--types", "test.sleep", "--concurrency", "8", env=env))
    try:
        wait_until(lambda: all_succeeded("test.sleep", 800), timeout=240, interval=0.5)
    finally:
        sampler.stop()
        steady.stop()
    report(
        f"800 x 50 ms, 4 x 8 threads ({'redis' if not limiter_mode else 'db'})",
        sampler,
        5,
        sampler.peak["test.sleep"],
        started,
    )
    assert sampler.peak["test.sleep"] <= 5
    assert sampler.peak["test.sleep"] >= 3  # the workers did run tasks side by side


def flush_limiter_keys() -> None:
    client = get_redis()
    for name in client.scan_iter("taskflow:*"):
        client.delete(name)


@pytest.mark.parametrize("disturbance", ["reconcile", "redis-flush"])
def test_limit_holds_while_claims_and_reports_are_in_flight(
    redis_client, start_worker, sampler, monkeypatch, disturbance
):
    set_limit("test.sleep", 3)
    # Tasks outlast a claim in flight, so a slot lost while claiming shows up as one task too many.
    taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 2.0}} for _ in range(9)])
    # Every claim stays in flight (slots taken, rows not yet processing) and every report too (rows
    # no longer processing, slots not yet given back) for longer than two measurements of drift
    # half a second apart, the reconciliation this test was written against. Reconciliation runs
    # all the while, or Redis is flushed in the middle of each report.
    reconciler = Repeating(reconcile_counters, 0.05, "reconciler")

    def in_flight(call: Callable[..., object], flush: bool, busy: int) -> Callable[..., object]:
        def slowly(*args: object, **kwargs: object) -> object:
            if args[busy]:  # slots granted, or attempts accepted (not an empty poll)
                time.sleep(0.6)
                if flush:
                    flush_limiter_keys()
                time.sleep(0.6)
            return call(*args, **kwargs)

        return slowly

    flush = disturbance == "redis-flush"
    monkeypatch.setattr(worker_module, "claim_batch", in_flight(worker_module.claim_batch, flush=False, busy=1))
    monkeypatch.setattr(finishing, "_give_slots_back", in_flight(finishing._give_slots_back, flush=flush, busy=0))
    started = time.monotonic()
    if disturbance == "reconcile":
        reconciler.start()
    try:
        worker = start_worker(["test.sleep"], concurrency=8)
        wait_until(lambda: all_succeeded("test.sleep", 9), timeout=120)
        worker.request_stop()  # an idle worker still reserves slots as it polls
    finally:
        if reconciler.is_alive():
            reconciler.stop()
        sampler.stop()
    report(f"claims and reports in flight ({disturbance})", sampler, 3, sampler.peak["test.sleep"], started)
    assert sampler.peak["test.sleep"] <= 3
    # Every slot came back (the set may be gone after the last flush), and nothing is left to correct.
    wait_until(lambda: worker.in_flight == worker.unreported == 0 and held_slots("test.sleep") in (0, None))
    assert reconcile_counters() == {"test.sleep": 0}


# -- an operator stops a running task ----------------------------------------------------------------


def test_a_stopped_tasks_handler_keeps_its_slot_until_it_returns(spawn, run_log, limiter_mode):
    """concurrency_limit=1: stopping a running task must not let a second handler start beside it."""
    task_type = "test.uses_db"  # logs start and end around a sleep; never looks at ctx.stop_requested
    set_limit(task_type, 1)
    x = taskflow.enqueue(task_type, {"sleep": 3}).pk
    y = taskflow.enqueue(task_type, {"sleep": 0}, run_after=0.3).pk
    worker = spawn("taskworker", "--types", task_type, "--concurrency", "4", env=limiter_mode)

    def logged(task_id: int, what: str) -> float | None:
        times = [float(r[4]) for r in read_runs(run_log) if r[0] == str(task_id) and r[2] == what]
        return times[0] if times else None

    wait_until(lambda: logged(x, "start"), timeout=30)
    wait_until(lambda: Task.objects.get(pk=y).run_after < timezone.now())  # y is due; the limit holds it
    assert operations.terminate([x], by="op", reason="test").changed == 1
    wait_until(lambda: Task.objects.get(pk=y).status == Status.SUCCESS and logged(x, "end"), timeout=30)
    x_end, y_start = logged(x, "end"), logged(y, "start")
    assert x_end is not None and y_start is not None
    assert y_start >= x_end, f"y started {x_end - y_start:.2f}s before the stopped handler returned"
    assert Task.objects.get(pk=x).status == Status.STOPPED
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0
    if not limiter_mode:
        assert held_slots(task_type) == 0
