"""The concurrency limiter: Redis Lua slot counters, their reconciliation, and the exact database limits."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import redis
from django.db import connection, transaction
from django.utils import timezone
from redis.backoff import NoBackoff
from redis.retry import Retry

import taskflow
from taskflow.engine import limiter, operations, rescue, workers
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.limiter import GATE, GLOBAL, Limiter, held_slots, holder, reconcile_counters, slots_key
from taskflow.models import Lock, ScheduleCfg, Status, Task, WorkerProcess

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


def limited_cfg(task_type: str, limit: int) -> ScheduleCfg:
    cfg = configs.get(task_type)
    ScheduleCfg.objects.filter(pk=task_type).update(concurrency_limit=limit)
    cfg.refresh_from_db()
    configs.clear()
    return cfg


@dataclass
class FakeAttempt:
    """A slot holder that is not a task row (for slot bookkeeping alone)."""

    task_type: str
    id: int
    lease_token: int = 1


def attempts(task_type: str, count: int, start: int = 1) -> list[FakeAttempt]:
    return [FakeAttempt(task_type, n) for n in range(start, start + count)]


def held(client, name: str) -> set[str]:  # noqa: ANN001
    """The attempts holding slots of `name` (reservations and the sentinel left out)."""
    members = {m.decode() for m in client.zrangebyscore(slots_key(name), "+inf", "+inf")}
    return members - {"#"}


def claim_with(slots: Limiter, cfg: ScheduleCfg, wanted: int, worker: str = "w1") -> list:  # noqa: ANN001
    """What the worker does: take slots, claim, confirm."""
    grant = slots.take(cfg.task_type, wanted, cfg.concurrency_limit)
    claimed = claim_batch(cfg, grant.slots, worker)
    slots.confirm(grant, claimed)
    return claimed


# -- Redis slots ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_take_never_grants_beyond_the_limit(redis_client):
    slots = Limiter()
    assert [slots.take("t.a", 2, 3).slots, slots.take("t.a", 2, 3).slots, slots.take("t.a", 1, 3).slots] == [2, 1, 0]
    assert held_slots("t.a") == 3


@pytest.mark.django_db
def test_confirm_holds_the_claimed_attempts_and_gives_back_the_rest(redis_client):
    slots = Limiter()
    grant = slots.take("t.a", 5, 5)
    assert grant.slots == 5
    a, b = attempts("t.a", 2)
    slots.confirm(grant, [a, b])
    assert held_slots("t.a") == 2
    assert held(redis_client, "t.a") == {"1:1", "2:1"}
    assert slots.take("t.a", 9, 5).slots == 3


@pytest.mark.django_db
def test_a_slot_is_given_back_once_per_attempt(redis_client):
    slots = Limiter()
    a, b = attempts("t.a", 2)
    slots.confirm(slots.take("t.a", 2, 2), [a, b])
    slots.release([a], {"t.a": 2})
    slots.release([a], {"t.a": 2})  # a duplicate report, or a rescue racing the report
    slots.release([FakeAttempt("t.a", 2, lease_token=0)], {"t.a": 2})  # an older attempt of the same task
    assert held(redis_client, "t.a") == {"2:1"}
    assert slots.take("t.a", 9, 2).slots == 1  # the double give-back did not open an extra slot


@pytest.mark.django_db
def test_release_reads_the_limits_when_not_given(redis_client):
    limited_cfg("t.a", 2)
    slots = Limiter()
    (a,) = attempts("t.a", 1)
    slots.confirm(slots.take("t.a", 1, 2), [a])
    slots.release([a])
    assert held_slots("t.a") == 0


@pytest.mark.django_db
def test_unlimited_type_takes_no_slot(redis_client):
    slots = Limiter()
    grant = slots.take("t.free", 40, 0)
    assert (grant.slots, grant.reservation) == (40, "")
    slots.confirm(grant, attempts("t.free", 40))
    slots.release(attempts("t.free", 40), {"t.free": 0})
    assert held_slots("t.free") is None


@pytest.mark.django_db
def test_unconfirmed_reservation_expires(redis_client, monkeypatch):
    monkeypatch.setattr(limiter, "RESERVATION_TTL", 0.3)
    slots = Limiter()
    assert slots.take("t.a", 3, 3).slots == 3  # and the worker dies before it confirms
    assert slots.take("t.a", 3, 3).slots == 0
    time.sleep(0.4)
    assert slots.take("t.a", 3, 3).slots == 3


@pytest.mark.django_db
def test_concurrent_takes_grant_exactly_the_limit(redis_client):
    slots = Limiter()
    slots.confirm(slots.take("t.a", 1, 5), [])  # builds the set here, where the database is
    start = threading.Barrier(16)
    grants: list[int] = []

    def take_once() -> None:
        start.wait()
        grants.append(slots.take("t.a", 2, 5).slots)

    run_threads(take_once, 16)
    assert sum(grants) == 5
    assert held_slots("t.a") == 5


@pytest.mark.django_db
def test_concurrent_takes_confirms_and_releases_never_hold_more_than_the_limit(redis_client):
    slots = Limiter()
    slots.confirm(slots.take("t.a", 1, 5), [])
    ids = itertools.count(1)
    holding, peak, granted_total = [0], [0], [0]
    lock = threading.Lock()

    def churn() -> None:
        mine: list[FakeAttempt] = []
        for _ in range(100):
            grant = slots.take("t.a", 2, 5)
            claimed = [FakeAttempt("t.a", next(ids)) for _ in range(grant.slots // 2 + grant.slots % 2)]
            slots.confirm(grant, claimed)
            with lock:  # the new attempts run while the previous ones end
                holding[0] += len(claimed)
                granted_total[0] += len(claimed)
                peak[0] = max(peak[0], holding[0])
                holding[0] -= len(mine)
            slots.release(mine, {"t.a": 5})
            mine = claimed
        with lock:
            holding[0] -= len(mine)
        slots.release(mine, {"t.a": 5})

    run_threads(churn, 16)
    print(f"\nthreads: peak slots held {peak[0]} (limit 5), {granted_total[0]} attempts in all")
    assert 0 < peak[0] <= 5
    assert held_slots("t.a") == 0


@pytest.mark.django_db
def test_type_and_global_slots_are_taken_together(redis_client, global_limit):
    global_limit(5)
    slots = Limiter()
    a = slots.take("t.a", 10, 3)
    assert a.slots == 3
    assert (held_slots("t.a"), held_slots(GLOBAL)) == (3, 3)
    free = slots.take("t.free", 10, 0)
    assert free.slots == 2  # unlimited type, but the global limit still counts
    assert slots.take("t.other", 1, 4).slots == 0
    assert held_slots("t.other") == 0  # a refused take leaves every set as it was
    first = attempts("t.a", 2)
    slots.confirm(a, first)
    assert (held_slots("t.a"), held_slots(GLOBAL)) == (2, 4)
    assert slots.take("t.free", 10, 0).slots == 1
    slots.confirm(free, [])
    assert held_slots(GLOBAL) == 3
    slots.release(first[:1], {"t.a": 3})
    assert (held(redis_client, "t.a"), held(redis_client, GLOBAL)) == ({"2:1"}, {"2:1"})
    assert slots.take("t.a", 10, 3).slots == 2  # the type's limit binds before the global one


@pytest.mark.django_db
def test_missing_sets_are_rebuilt_from_the_processing_attempts(redis_client, global_limit):
    global_limit(4)
    a = add_tasks("t.a", 2, Status.PROCESSING)
    b = add_tasks("t.b", 1, Status.PROCESSING)
    slots = Limiter()
    assert slots.take("t.a", 5, 3).slots == 1
    assert held(redis_client, "t.a") == {f"{i}:0" for i in a}
    assert held(redis_client, GLOBAL) == {f"{i}:0" for i in a + b}
    redis_client.delete(slots_key(GLOBAL))  # e.g. evicted
    assert slots.take("t.b", 5, 0).slots == 1  # rebuilt from the database: 3 rows (the grant is not one yet)
    assert held_slots(GLOBAL) == 4


@pytest.mark.django_db
def test_unreachable_redis_stops_limited_types_only(global_limit):
    slots = Limiter(client=unreachable_redis())
    assert slots.take("t.a", 3, 2).slots == 0
    assert slots.take("t.free", 3, 0).slots == 3
    slots.release(attempts("t.a", 2), {"t.a": 2})  # logged, not raised: left to reconciliation
    global_limit(10)
    assert slots.take("t.free", 3, 0).slots == 0  # a global limit makes every type a limited one


@pytest.mark.django_db
def test_after_a_failure_redis_is_left_alone_for_a_while():
    client = DeadRedis()
    slots = Limiter(client=client)
    assert slots.take("t.a", 3, 2).slots == 0
    assert slots.take("t.a", 3, 2).slots == 0
    slots.release(attempts("t.a", 1), {"t.a": 2})
    assert client.calls == 1
    wait_until(lambda: slots.take("t.a", 3, 2).slots == 0 and client.calls == 2, timeout=10)


class FailsOnce:
    """A Redis client that loses the first call of one Lua script, and passes everything else through."""

    def __init__(self, client, script: str) -> None:  # noqa: ANN001
        self.client, self.script, self.failed = client, script, False

    def eval(self, script: str, *args: object) -> object:
        if script == self.script and not self.failed:
            self.failed = True
            raise redis.ConnectionError("connection reset")
        return self.client.eval(script, *args)


@pytest.mark.django_db
def test_a_lost_confirm_is_sent_again_before_the_next_take(redis_client):
    slots = Limiter(client=FailsOnce(redis_client, limiter._CONFIRM))
    grant = slots.take("t.a", 3, 3)
    slots.confirm(grant, attempts("t.a", 2))  # lost: the reservation still holds all 3 slots
    assert held_slots("t.a") == 3
    wait_until(lambda: slots.take("t.a", 3, 3).slots == 1, timeout=10)
    assert held(redis_client, "t.a") == {"1:1", "2:1"}


# -- a Redis restart or flush -----------------------------------------------------------------------


@pytest.mark.django_db
def test_a_redis_flush_is_recovered_exactly(redis_client):
    cfg = limited_cfg("t.a", 3)
    add_tasks("t.a", 6)
    slots = Limiter()
    running = claim_with(slots, cfg, 3)
    assert held_slots("t.a") == 3
    # The first attempt's final update lands, then Redis loses everything before its slot comes back.
    done = running[0]
    assert finish_attempts([Report(done, Outcome.SUCCESS)], cfgs={"t.a": cfg}, limiter=Limiter(client=None)) != []
    redis_client.flushdb()
    assert held_slots("t.a") is None
    assert len(claim_with(slots, cfg, 3)) == 1  # rebuilt from the 2 processing attempts
    slots.release([done], {"t.a": 3})  # the late give-back frees nothing it should not
    assert held_slots("t.a") == 3
    assert claim_with(slots, cfg, 3) == []
    assert reconcile_counters() == {"t.a": 3}
    assert held(redis_client, "t.a") == {f"{t}:{token}" for t, token in processing_attempts("t.a")}


def processing_attempts(task_type: str) -> list[tuple[int, int]]:
    return list(Task.objects.filter(task_type=task_type, status=Status.PROCESSING).values_list("id", "lease_token"))


# -- reconciliation --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_reconcile_frees_ended_attempts_and_adds_forgotten_ones(redis_client, global_limit):
    global_limit(10)
    limited_cfg("t.a", 3)
    limited_cfg("t.b", 3)
    limited_cfg("t.c", 2)
    limited_cfg("t.free", 0)
    running_a = add_tasks("t.a", 2, Status.PROCESSING)
    add_tasks("t.a", 4)
    running_b = add_tasks("t.b", 2, Status.PROCESSING)
    running_c = add_tasks("t.c", 1, Status.PROCESSING)
    running_free = add_tasks("t.free", 1, Status.PROCESSING)
    slots = Limiter()
    # Build the sets of t.a, t.b and the global one; the grants stay reserved (claims in flight).
    assert (slots.take("t.a", 1, 3).slots, slots.take("t.b", 1, 3).slots) == (1, 1)
    leaked = [FakeAttempt("t.a", 999_001), FakeAttempt("t.a", running_a[0], lease_token=7)]
    redis_client.zadd(slots_key("t.a"), {holder(a): "+inf" for a in leaked})  # a crashed worker's
    redis_client.zrem(slots_key("t.b"), f"{running_b[0]}:0")  # a lost confirm
    redis_client.zadd(slots_key("t.free"), {"5:5": "+inf", "#": "+inf"})  # from when the type had a limit
    redis_client.zrem(slots_key(GLOBAL), *(f"{i}:0" for i in running_b + running_c))

    # t.a: 2 attempts + 1 reserved; t.b: 2 + 1; t.c had no set; global: 6 attempts + 2 reserved
    assert reconcile_counters() == {"t.a": 3, "t.b": 3, "t.c": 1, GLOBAL: 8}
    assert held(redis_client, "t.a") == {f"{i}:0" for i in running_a}
    assert held(redis_client, "t.b") == {f"{i}:0" for i in running_b}
    assert held(redis_client, GLOBAL) == {f"{i}:0" for i in running_a + running_b + running_c + running_free}
    assert held_slots("t.free") is None


@pytest.mark.django_db
def test_reconcile_keeps_the_slots_of_claims_and_reports_in_flight(redis_client):
    cfg = limited_cfg("t.a", 3)
    add_tasks("t.a", 6)
    slots = Limiter()
    running = claim_with(slots, cfg, 2)
    # A claim in flight: slots taken, rows not processing yet (and committed, not yet confirmed).
    grant = slots.take("t.a", 3, 3)
    assert grant.slots == 1
    assert reconcile_counters() == {"t.a": 3}
    claimed = claim_batch(cfg, grant.slots, "w2")
    assert reconcile_counters() == {"t.a": 4}  # counted twice until the confirm: too few claims, never too many
    assert slots.take("t.a", 3, 3).slots == 0
    slots.confirm(grant, claimed)
    assert held_slots("t.a") == 3
    # A report in flight: the final update is written, its slot not given back yet.
    done = running[0]
    finish_attempts([Report(done, Outcome.SUCCESS)], cfgs={"t.a": cfg}, limiter=Limiter(client=None))
    assert reconcile_counters() == {"t.a": 2}  # read before the rows, and no longer processing: freed
    slots.release([done], {"t.a": 3})  # arrives late, and changes nothing
    assert held_slots("t.a") == 2
    assert len(claim_with(slots, cfg, 3)) == 1


@pytest.mark.django_db
def test_reconcile_never_frees_an_attempt_that_joined_after_it_read_redis(redis_client, monkeypatch):
    cfg = limited_cfg("t.a", 2)
    add_tasks("t.a", 2)
    slots = Limiter()
    slots.confirm(slots.take("t.a", 1, 2), [])
    grant = slots.take("t.a", 2, 2)
    claimed = claim_batch(cfg, grant.slots, "w1")
    read_rows = limiter._processing_attempts

    def confirmed_meanwhile(names: list[str]) -> dict[str, list[str]]:
        slots.confirm(grant, claimed)  # between reconciliation's read of Redis and of the rows
        return read_rows(names)

    monkeypatch.setattr(limiter, "_processing_attempts", confirmed_meanwhile)
    assert reconcile_counters() == {"t.a": 2}
    assert slots.take("t.a", 1, 2).slots == 0


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


# -- a task stopped while its handler still runs -------------------------------------------------------


def exact_claim(cfg: ScheduleCfg) -> list:
    return claim_batch(cfg, 1, "w1", exact_limit=cfg.concurrency_limit, exact_global_limit=0)


@pytest.mark.django_db(transaction=True)
def test_a_stopped_attempt_keeps_its_exact_slot_until_its_handler_returns():
    cfg = limited_cfg("t.a", 1)
    add_tasks("t.a", 2)
    [x] = exact_claim(cfg)
    operations.terminate([x.id], by="op")
    assert Task.objects.get(pk=x.id).status == Status.STOPPED
    assert exact_claim(cfg) == []  # its handler still runs
    with transaction.atomic():
        assert limiter.exact_room("t.b", 5, 0, 2) == 1  # the global count holds it too
    assert finish_attempts([Report(x, Outcome.SUCCESS, result={})]) == []  # refused: the task was stopped
    [y] = exact_claim(cfg)  # the handler returned: its slot is free, once
    finish_attempts([Report(x, Outcome.SUCCESS, result={})])  # the same report again frees nothing more
    assert y.id != x.id and exact_claim(cfg) == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("late", [Outcome.TERMINATED, Outcome.RESCUED])
def test_a_second_stop_or_a_rescue_racing_the_first_stop_frees_nothing(late):
    cfg = limited_cfg("t.a", 1)
    add_tasks("t.a", 2)
    [x] = exact_claim(cfg)
    operations.terminate([x.id], by="op")
    # As read by another operator, or taskwatch, before the first stop committed: refused.
    assert finish_attempts([Report(x, late, error="late")]) == []
    assert exact_claim(cfg) == []  # the handler still runs


@pytest.mark.django_db(transaction=True)
def test_a_stopped_attempt_keeps_its_slot_until_its_deadline_passes():
    cfg = limited_cfg("t.a", 1)
    x_id = taskflow.enqueue("t.a", {}, timeout=1).pk
    add_tasks("t.a", 1)
    workers.beat("w1", "host", ["t.a"], 1)
    [x] = exact_claim(cfg)
    operations.terminate([x_id], by="op")
    assert rescue.free_lingering_slots() == 0  # deadline ahead, worker alive
    assert exact_claim(cfg) == []
    wait_until(lambda: timezone.now() > x.lease_expires_at + timedelta(seconds=0.2), timeout=5)
    workers.beat("w1", "host", ["t.a"], 1)
    assert len(exact_claim(cfg)) == 1  # past its deadline the stopped attempt no longer counts
    assert rescue.free_lingering_slots() == 1  # and taskwatch removes it


@pytest.mark.django_db(transaction=True)
def test_a_dead_workers_stopped_attempt_gives_its_slot_back(redis_client):
    cfg = limited_cfg("t.a", 1)
    add_tasks("t.a", 2)
    workers.beat("w1", "host", ["t.a"], 1)
    slots = Limiter()
    [x] = claim_with(slots, cfg, 1)
    operations.terminate([x.id], by="op")
    assert held(redis_client, "t.a") == {holder(x)}
    WorkerProcess.objects.filter(worker_id="w1").update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert rescue.free_lingering_slots() == 1
    assert held(redis_client, "t.a") == set()
    assert len(claim_with(slots, cfg, 1)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_stopped_attempt_keeps_its_redis_slot_until_its_handler_returns(redis_client, global_limit):
    global_limit(5)
    cfg = limited_cfg("t.a", 1)
    add_tasks("t.a", 2)
    slots = Limiter()
    [x] = claim_with(slots, cfg, 1)
    operations.terminate([x.id], by="op")
    assert held(redis_client, "t.a") == held(redis_client, GLOBAL) == {holder(x)}
    assert claim_with(slots, cfg, 1) == []
    assert reconcile_counters() == {"t.a": 1, GLOBAL: 1}  # taskwatch's reconcile keeps it
    redis_client.delete(slots_key("t.a"))  # Redis forgot: the rebuild holds it again
    assert claim_with(slots, cfg, 1) == [] and held(redis_client, "t.a") == {holder(x)}
    finish_attempts([Report(x, Outcome.LOST)], limiter=slots)  # the handler returned (LeaseLost)
    assert held(redis_client, "t.a") == held(redis_client, GLOBAL) == set()
    assert len(claim_with(slots, cfg, 1)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_remote_workers_stopped_attempt_keeps_its_slot_until_its_deadline():
    from taskflow.engine import remote

    limited_cfg("t.a", 1)
    taskflow.enqueue("t.a", {}, timeout=1)
    add_tasks("t.a", 1)
    worker = "host-r:0:remote"
    [x] = remote.hold(["t.a"], 1, worker)
    operations.terminate([x.id], by="op")
    assert remote.hold(["t.a"], 1, worker) == []  # its handler may still run, out of our sight
    wait_until(lambda: timezone.now() > x.lease_expires_at + timedelta(seconds=0.2), timeout=5)
    remote.beat(worker)
    assert rescue.free_lingering_slots() == 1  # taskwatch, at the deadline
    assert len(remote.hold(["t.a"], 1, worker)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_remote_workers_stopped_attempt_gives_its_slot_back_when_its_holder_reports():
    from taskflow.engine import remote

    limited_cfg("t.a", 1)
    taskflow.enqueue("t.a", {}, timeout=60)
    add_tasks("t.a", 1)
    worker = "host-r:0:remote"
    [x] = remote.hold(["t.a"], 1, worker)
    operations.terminate([x.id], by="op")
    assert remote.hold(["t.a"], 1, worker) == []  # its handler still runs
    held = remote.Held(x.id, x.lease_token, remote.attempt_key(x.id, x.lease_token, worker))
    assert remote.finish(worker, [remote.RemoteReport(held, Outcome.SUCCESS)]) == [remote.Refused.LEASE_LOST]
    assert len(remote.hold(["t.a"], 1, worker)) == 1  # the handler returned: its slot is free at once


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("operation", ["retry_now", "reschedule"])
def test_a_stopped_task_is_not_run_again_while_its_handler_runs(operation: str):
    """Retry now (or reschedule) of a task stopped mid-run waits for its handler: else it runs twice at once."""
    cfg = limited_cfg("t.a", 0)
    add_tasks("t.a", 1)
    [x] = claim_batch(cfg, 1, "w1:1:a")
    operations.terminate([x.id], by="op")
    run_again = getattr(operations, operation)
    options = {"run_after": 0} if operation == "reschedule" else {}
    result = run_again([x.id], by="op", **options)
    assert (result.changed, result.skipped) == (0, {operations.HANDLER_RUNNING: 1})
    assert Task.objects.get(pk=x.id).status == Status.STOPPED
    finish_attempts([Report(x, Outcome.LOST)])  # the handler returned (LeaseLost)
    assert run_again([x.id], by="op", **options).changed == 1
    assert Task.objects.get(pk=x.id).status == Status.PENDING


@pytest.mark.django_db(transaction=True)
def test_re_enqueueing_a_key_stopped_while_its_handler_runs_waits_for_that_handlers_deadline():
    """A stopped task re-enqueued in place would otherwise run beside its own handler."""
    cfg = limited_cfg("t.a", 0)
    task = taskflow.enqueue("t.a", {}, key="order-1", timeout=60)
    [x] = claim_batch(cfg, 1, "w1:1:a")
    operations.terminate([x.id], by="op")
    again = taskflow.enqueue("t.a", {}, key="order-1", timeout=60)
    assert (again.pk, again.status) == (task.pk, Status.PENDING)
    assert again.run_after >= x.lease_expires_at
    assert claim_batch(cfg, 1, "w2:1:b") == []  # not beside the handler still running
    assert operations.retry_now([x.id], by="op").skipped == {operations.HANDLER_RUNNING: 1}  # nor made due early
    finish_attempts([Report(x, Outcome.LOST)])  # the handler returned
    assert operations.retry_now([x.id], by="op").changed == 1
    assert [c.id for c in claim_batch(cfg, 1, "w2:1:b")] == [x.id]
