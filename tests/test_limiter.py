"""The concurrency limiter: Redis Lua slot counters, their reconciliation, and the exact database limits."""

from __future__ import annotations

import socket
import threading

import pytest
import redis
from django.db import connection
from redis.backoff import NoBackoff
from redis.retry import Retry

import taskflow
from taskflow.engine import limiter
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.limiter import GATE, GLOBAL, Limiter, counter_key, reconcile_counters
from taskflow.models import Lock, ScheduleCfg, Status, Task

from .conftest import wait_until


@pytest.fixture
def global_limit(settings):  # noqa: ANN001, ANN201
    """Set TASKFLOW["GLOBAL_CONCURRENCY_LIMIT"] for one test."""

    def set_limit(value: int) -> None:
        settings.TASKFLOW = {**settings.TASKFLOW, "GLOBAL_CONCURRENCY_LIMIT": value}

    return set_limit


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unreachable_redis() -> redis.Redis:
    # No retries: the default policy would spend seconds on every call.
    return redis.Redis(host="127.0.0.1", port=closed_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


class DeadRedis:
    """A client whose every script fails, counting the attempts."""

    def __init__(self) -> None:
        self.calls = 0

    def eval(self, *args: object) -> int:
        self.calls += 1
        raise redis.ConnectionError("connection refused")


def add_tasks(task_type: str, count: int, status: str = Status.PENDING) -> list[int]:
    ids = [taskflow.enqueue(task_type, {"n": n}).pk for n in range(count)]
    if status != Status.PENDING:
        Task.objects.filter(pk__in=ids).update(status=status)
    return ids


def run_threads(target, count: int) -> None:  # noqa: ANN001
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)


def counter(client, name: str) -> int | None:  # noqa: ANN001
    value = client.get(counter_key(name))
    return None if value is None else int(value)


def limited_cfg(task_type: str, limit: int) -> ScheduleCfg:
    cfg = configs.get(task_type)
    ScheduleCfg.objects.filter(pk=task_type).update(concurrency_limit=limit)
    cfg.refresh_from_db()
    return cfg


# -- Redis slot counters ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_take_never_grants_beyond_the_limit(redis_client):
    slots = Limiter()
    assert [slots.take("t.a", 2, 3), slots.take("t.a", 2, 3), slots.take("t.a", 1, 3)] == [2, 1, 0]
    assert counter(redis_client, "t.a") == 3


@pytest.mark.django_db
def test_give_back_never_goes_below_zero(redis_client):
    slots = Limiter()
    assert slots.take("t.a", 2, 5) == 2
    slots.give_back("t.a", 5, 5)
    assert counter(redis_client, "t.a") == 0
    assert slots.take("t.a", 9, 5) == 5  # the over-return did not open extra slots


@pytest.mark.django_db
def test_unlimited_type_takes_no_slot(redis_client):
    slots = Limiter()
    assert slots.take("t.free", 40, 0) == 40
    slots.give_back("t.free", 40, 0)
    assert counter(redis_client, "t.free") is None


@pytest.mark.django_db
def test_concurrent_takes_grant_exactly_the_limit(redis_client):
    slots = Limiter()
    assert slots.take("t.a", 1, 5) == 1  # initialises the counter here, where the database is
    slots.give_back("t.a", 1, 5)
    start = threading.Barrier(16)
    grants: list[int] = []

    def take_once() -> None:
        start.wait()
        grants.append(slots.take("t.a", 2, 5))

    run_threads(take_once, 16)
    assert sum(grants) == 5
    assert counter(redis_client, "t.a") == 5


@pytest.mark.django_db
def test_concurrent_takes_and_give_backs_never_hold_more_than_the_limit(redis_client):
    slots = Limiter()
    assert slots.take("t.a", 1, 5) == 1
    slots.give_back("t.a", 1, 5)
    held, peak, granted_total = [0], [0], [0]
    lock = threading.Lock()

    def churn() -> None:
        for _ in range(200):
            granted = slots.take("t.a", 2, 5)
            with lock:
                held[0] += granted
                granted_total[0] += granted
                peak[0] = max(peak[0], held[0])
            with lock:
                held[0] -= granted
            slots.give_back("t.a", granted, 5)

    run_threads(churn, 16)
    print(f"\nthreads: peak slots held {peak[0]} (limit 5), {granted_total[0]} granted in all")
    assert 0 < peak[0] <= 5
    assert counter(redis_client, "t.a") == 0


@pytest.mark.django_db
def test_type_and_global_slots_are_taken_together(redis_client, global_limit):
    global_limit(5)
    slots = Limiter()
    assert slots.take("t.a", 10, 3) == 3
    assert (counter(redis_client, "t.a"), counter(redis_client, GLOBAL)) == (3, 3)
    assert slots.take("t.free", 10, 0) == 2  # unlimited type, but the global limit still counts
    assert slots.take("t.other", 1, 4) == 0
    assert counter(redis_client, "t.other") == 0  # a refused take leaves every counter as it was
    slots.give_back("t.a", 1, 3)
    assert (counter(redis_client, "t.a"), counter(redis_client, GLOBAL)) == (2, 4)
    assert slots.take("t.free", 10, 0) == 1
    slots.give_back("t.free", 3, 0)
    assert counter(redis_client, GLOBAL) == 2
    assert slots.take("t.a", 10, 3) == 1  # the type's limit binds before the global one


@pytest.mark.django_db
def test_missing_counters_start_from_the_processing_rows(redis_client, global_limit):
    global_limit(4)
    add_tasks("t.a", 2, Status.PROCESSING)
    add_tasks("t.b", 1, Status.PROCESSING)
    slots = Limiter()
    assert slots.take("t.a", 5, 3) == 1
    assert (counter(redis_client, "t.a"), counter(redis_client, GLOBAL)) == (3, 4)
    redis_client.delete(counter_key(GLOBAL))  # e.g. evicted
    assert slots.take("t.b", 5, 0) == 1  # recounted from the database: 3 rows (the grant is not one yet)
    assert counter(redis_client, GLOBAL) == 4


@pytest.mark.django_db
def test_unreachable_redis_stops_limited_types_only(global_limit):
    slots = Limiter(client=unreachable_redis())
    assert slots.take("t.a", 3, 2) == 0
    assert slots.take("t.free", 3, 0) == 3
    slots.give_back("t.a", 2, 2)  # logged, not raised: the counter is reconciled later
    global_limit(10)
    assert slots.take("t.free", 3, 0) == 0  # a global limit makes every type a limited one


@pytest.mark.django_db
def test_after_a_failure_redis_is_left_alone_for_a_while():
    client = DeadRedis()
    slots = Limiter(client=client)
    assert slots.take("t.a", 3, 2) == 0
    assert slots.take("t.a", 3, 2) == 0
    slots.give_back("t.a", 1, 2)
    assert client.calls == 1
    wait_until(lambda: slots.take("t.a", 3, 2) == 0 and client.calls == 2, timeout=10)


# -- reconciliation --------------------------------------------------------------------------------


@pytest.fixture
def no_gap(monkeypatch):  # noqa: ANN001, ANN201
    """Reconcile without pausing between the two drift measurements."""
    monkeypatch.setattr(limiter, "RECONCILE_GAP", 0)


@pytest.mark.django_db
def test_reconcile_corrects_counters_to_the_processing_rows(redis_client, global_limit, no_gap):
    global_limit(10)
    limited_cfg("t.a", 3)
    limited_cfg("t.b", 2)
    limited_cfg("t.c", 2)
    limited_cfg("t.free", 0)
    add_tasks("t.a", 2, Status.PROCESSING)
    add_tasks("t.a", 4)
    add_tasks("t.b", 2, Status.PROCESSING)
    add_tasks("t.c", 1, Status.PROCESSING)
    add_tasks("t.free", 1, Status.PROCESSING)
    redis_client.set(counter_key("t.a"), 7)  # leaked by a crashed worker
    redis_client.set(counter_key("t.b"), 0)  # too low: the limit was raised from 0 while tasks ran
    redis_client.set(counter_key("t.free"), 5)  # left from when the type had a limit
    redis_client.set(counter_key(GLOBAL), 1)  # too low: Redis lost writes
    assert reconcile_counters() == {"t.a": 2, "t.b": 2, "t.c": 1, GLOBAL: 6}  # t.c's counter was missing
    assert [counter(redis_client, n) for n in ("t.a", "t.b", "t.c", GLOBAL, "t.free")] == [2, 2, 1, 6, None]


@pytest.mark.django_db
def test_reconcile_keeps_the_slots_of_a_claim_in_progress(redis_client, no_gap, monkeypatch):
    limited_cfg("t.a", 5)
    add_tasks("t.a", 1, Status.PROCESSING)
    slots = Limiter()
    assert slots.take("t.a", 5, 5) == 4  # counter 1 (initialised) + 4 granted, rows not claimed yet
    assert slots.take("t.a", 5, 5) == 0
    count = limiter._processing_counts
    measured = []

    def count_while_the_claim_commits(names: list[str]) -> dict[str, int]:
        counts = count(names)
        measured.append(counts)
        if len(measured) == 1:  # between the two measurements: 2 claimed, 2 grants given back
            add_tasks("t.a", 2, Status.PROCESSING)
            slots.give_back("t.a", 2, 5)
        return counts

    monkeypatch.setattr(limiter, "_processing_counts", count_while_the_claim_commits)
    assert reconcile_counters() == {"t.a": 3}
    assert slots.take("t.a", 5, 5) == 2


@pytest.mark.django_db
def test_reconcile_removes_only_the_drift_both_measurements_show(redis_client, no_gap, monkeypatch):
    limited_cfg("t.a", 5)
    add_tasks("t.a", 1, Status.PROCESSING)
    redis_client.set(counter_key("t.a"), 4)  # 3 leaked
    count = limiter._processing_counts
    calls = []

    def count_while_slots_move(names: list[str]) -> dict[str, int]:
        calls.append(1)
        if len(calls) == 2:  # a claim of 2 in progress during the second measurement
            redis_client.incrby(counter_key("t.a"), 2)
        return count(names)

    monkeypatch.setattr(limiter, "_processing_counts", count_while_slots_move)
    assert reconcile_counters() == {"t.a": 3}  # 1 row + the 2 granted; the 3 leaked are gone


@pytest.mark.django_db
def test_reconcile_without_redis_reports_nothing(monkeypatch):
    limited_cfg("t.a", 5)
    client = unreachable_redis()
    monkeypatch.setattr(limiter, "get_redis", lambda: client)
    assert reconcile_counters() == {}
    monkeypatch.setattr(limiter, "get_redis", lambda: None)
    assert reconcile_counters() == {}


# -- exact limits in the database ----------------------------------------------------------------


@pytest.mark.django_db
def test_exact_type_limit_counts_processing_rows():
    cfg = limited_cfg("t.a", 3)
    add_tasks("t.a", 2, Status.PROCESSING)
    add_tasks("t.a", 5)
    assert len(claim_batch(cfg, 10, "w1", exact_limit=3, exact_global_limit=0)) == 1
    assert claim_batch(cfg, 10, "w1", exact_limit=3, exact_global_limit=0) == []


@pytest.mark.django_db
def test_exact_global_limit_counts_every_type():
    cfg = configs.get("t.b")
    add_tasks("t.a", 2, Status.PROCESSING)
    add_tasks("t.b", 5)
    assert len(claim_batch(cfg, 10, "w1", exact_global_limit=3)) == 1
    assert claim_batch(cfg, 10, "w1", exact_global_limit=3) == []
    assert Lock.objects.filter(name=GATE).exists()


@pytest.mark.django_db
def test_exact_global_limit_applies_by_default_only_without_redis(global_limit, monkeypatch):
    global_limit(2)
    monkeypatch.setattr(limiter, "get_redis", lambda: object())
    assert limiter.exact_global_limit() == 0
    monkeypatch.setattr(limiter, "get_redis", lambda: None)
    add_tasks("t.b", 5)
    assert len(claim_batch(configs.get("t.b"), 10, "w1")) == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("type_limit", "global_limit_", "expected"), [(3, 0, 3), (0, 4, 4), (3, 4, 4)])
def test_exact_limits_hold_between_concurrent_claimers(type_limit, global_limit_, expected):
    cfgs = [limited_cfg("t.a", type_limit), limited_cfg("t.b", type_limit)]
    for cfg in cfgs:
        add_tasks(cfg.task_type, 10)
    start = threading.Barrier(8)
    claimed: list[int] = []
    errors: list[BaseException] = []

    def claim(n: int) -> None:
        try:
            start.wait()
            for _ in range(5):
                tasks = claim_batch(cfgs[n % 2], 2, f"w{n}", exact_limit=type_limit, exact_global_limit=global_limit_)
                claimed.extend(t.id for t in tasks)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    processing = Task.objects.filter(status=Status.PROCESSING)
    per_type = [processing.filter(task_type=cfg.task_type).count() for cfg in cfgs]
    assert len(claimed) == len(set(claimed)) == processing.count()
    if global_limit_:
        assert sum(per_type) == expected
    if type_limit:
        assert max(per_type) <= type_limit
    if not global_limit_:
        assert per_type == [type_limit, type_limit]
