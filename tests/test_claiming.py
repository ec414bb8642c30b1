"""claim_batch: which due tasks a worker gets, in what order, and that no task is claimed twice."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

import taskflow
from taskflow.engine import sql
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.rescue import hand_back_unheld
from taskflow.models import ScheduleCfg, Status, Task

T = "test.noop"


def cfg_with(**fields: object) -> ScheduleCfg:
    """The type's ScheduleCfg with `fields` saved, and the cache refreshed so enqueue sees them."""
    cfg = configs.get(T)
    for name, value in fields.items():
        setattr(cfg, name, value)
    cfg.save()
    configs.clear()
    return configs.get(T)


def claim_all(cfg: ScheduleCfg, limit: int = 1, **kwargs: object) -> list[int]:
    """Claim `limit` at a time until nothing is left; the ids in claim order."""
    order: list[int] = []
    while batch := claim_batch(cfg, limit, "w1", **kwargs):
        order.extend(t.id for t in batch)
    return order


@pytest.mark.django_db
def test_higher_priority_is_claimed_first() -> None:
    cfg = cfg_with(priority_aging=1.0)
    due = timezone.now() - timedelta(minutes=1)
    by_priority = {p: taskflow.enqueue(T, {"p": p}, priority=p, run_after=due).pk for p in (0, -100, 100, 7, -3)}

    claimed = claim_batch(cfg, 10, "w1")

    assert [t.id for t in claimed] == [by_priority[p] for p in (100, 7, 0, -3, -100)]


@pytest.mark.django_db
def test_within_one_priority_the_earliest_due_runs_first() -> None:
    cfg = cfg_with(priority_aging=1.0)
    t0 = timezone.now() - timedelta(hours=1)
    ids = [taskflow.enqueue(T, run_after=t0 + timedelta(seconds=s)).pk for s in (30, 10, 20)]
    assert claim_all(cfg, limit=2) == [ids[1], ids[2], ids[0]]


@pytest.mark.django_db
def test_priority_aging_means_an_old_low_priority_task_is_not_starved() -> None:
    """order_time = run_after - priority * aging, and claims go by order_time.

    So a task of priority p_low due at t0 is overtaken only by tasks of priority p_high due before
    t0 + (p_high - p_low) * aging. With aging 2 s and priorities 0 vs 50 that window is 100 s: a
    high-priority task due 99 s later still runs first, one due 101 s later (or any time after)
    waits its turn, however many of them arrive.
    """
    cfg = cfg_with(priority_aging=2.0)
    t0 = timezone.now() - timedelta(hours=1)
    low = taskflow.enqueue(T, {"low": True}, priority=0, run_after=t0).pk
    inside = [taskflow.enqueue(T, priority=50, run_after=t0 + timedelta(seconds=s)).pk for s in (60, 99)]
    flood = [taskflow.enqueue(T, priority=50, run_after=t0 + timedelta(seconds=101 + s)).pk for s in range(20)]

    order = claim_all(cfg, limit=3)

    assert order == [*inside, low, *flood]
    row = Task.objects.get(pk=low)
    assert row.order_time == t0
    assert Task.objects.get(pk=inside[1]).order_time == t0 + timedelta(seconds=99 - 100)


@pytest.mark.django_db
def test_with_aging_zero_priority_gives_no_head_start() -> None:
    cfg = cfg_with(priority_aging=0.0)
    t0 = timezone.now() - timedelta(days=1)
    low = taskflow.enqueue(T, priority=-100, run_after=t0).pk
    high = taskflow.enqueue(T, priority=100, run_after=t0 + timedelta(seconds=1)).pk
    assert claim_all(cfg) == [low, high]


@pytest.mark.django_db
def test_a_claim_takes_only_due_pending_tasks_of_its_type_up_to_the_limit() -> None:
    cfg = cfg_with()
    now = timezone.now()
    due = [taskflow.enqueue(T, {"i": i}, run_after=now - timedelta(seconds=10 - i)).pk for i in range(5)]
    later = taskflow.enqueue(T, run_after=now + timedelta(minutes=5)).pk
    taskflow.enqueue("test.record")
    finished = taskflow.enqueue(T, run_after=now - timedelta(minutes=1))
    Task.objects.filter(pk=finished.pk).update(status=Status.SUCCESS)

    first = claim_batch(cfg, 3, "w1", now=now)
    second = claim_batch(cfg, 3, "w2", now=now)

    assert [t.id for t in first] == due[:3]
    assert [t.id for t in second] == due[3:]
    assert claim_batch(cfg, 3, "w3", now=now) == []
    assert [t.id for t in claim_batch(cfg, 3, "w3", now=now + timedelta(minutes=6))] == [later]
    assert claim_batch(cfg, 0, "w1") == []


# Behind a long queue, a claim on MariaDB reads the first `limit` + CANDIDATE_MARGIN pending rows as
# candidates before it locks any (sql.select_due): the next tests fill the head of the queue with more
# rows it must pass over, and run both with candidates and with the plain locking scan.
HEAD = sql.CANDIDATE_MARGIN + 20


class _Queues(set):
    """sql._long_queues, held to say every queue is long (or none is) whatever the claims find."""

    def __init__(self, long: bool) -> None:
        super().__init__()
        self.long = long

    def __contains__(self, task_type: object) -> bool:
        return self.long

    def add(self, task_type: object) -> None:
        pass

    def discard(self, task_type: object) -> None:
        pass


@pytest.fixture(params=["long queue", "short queue"])
def queue(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sql, "_long_queues", _Queues(request.param == "long queue"))
    return request.param


@pytest.mark.django_db
def test_a_full_claim_marks_its_queue_long_and_a_short_one_short(monkeypatch: pytest.MonkeyPatch) -> None:
    if sql.claims_in_one_statement():
        pytest.skip("PostgreSQL claims in one statement, with no candidate read")
    monkeypatch.setattr(sql, "_long_queues", set())
    cfg = cfg_with()
    taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(15)])
    assert len(claim_batch(cfg, 10, "w1")) == 10
    assert T in sql._long_queues
    assert len(claim_batch(cfg, 10, "w1")) == 5
    assert T not in sql._long_queues


@pytest.mark.django_db
def test_due_tasks_are_claimed_behind_a_head_of_tasks_not_due_yet(queue: str) -> None:
    """High-priority tasks scheduled later sort first (order_time = run_after - priority x aging)."""
    cfg = cfg_with(priority_aging=1.0)
    now = timezone.now()
    later = now + timedelta(seconds=30)
    taskflow.enqueue_many(
        [{"task_type": T, "payload": {"i": i}, "priority": 100, "run_after": later} for i in range(HEAD)]
    )
    due = [taskflow.enqueue(T, {"due": i}, run_after=now - timedelta(seconds=5 - i)).pk for i in range(3)]
    assert Task.objects.filter(order_time__lt=now - timedelta(seconds=10)).count() == HEAD  # they do come first

    assert [t.id for t in claim_batch(cfg, 10, "w1", now=now)] == due
    assert claim_batch(cfg, 10, "w1", now=now) == []


@pytest.mark.django_db
def test_due_tasks_are_claimed_behind_a_head_of_tasks_kept_for_another_host(queue: str) -> None:
    cfg = cfg_with()
    now = timezone.now()
    kept = taskflow.enqueue_many(
        [{"task_type": T, "payload": {"i": i}, "run_after": now - timedelta(minutes=1)} for i in range(HEAD)]
    )
    Task.objects.filter(pk__in=[t.pk for t in kept]).update(
        prefer_host="alpha", prefer_host_until=now + timedelta(minutes=1)
    )
    free = [taskflow.enqueue(T, {"free": i}, run_after=now - timedelta(seconds=5 - i)).pk for i in range(3)]

    assert [t.id for t in claim_batch(cfg, 10, "w-beta", host="beta", now=now)] == free
    assert len(claim_batch(cfg, 500, "w-alpha", host="alpha", now=now)) == HEAD


def lockable(other: Any, ids: list[int]) -> list[int]:
    """Which of these rows connection `other` can lock now (it keeps the locks until it rolls back)."""
    with other.cursor() as cursor:
        marks = ", ".join(["%s"] * len(ids))
        cursor.execute(f"SELECT id FROM {sql.task_table()} WHERE id IN ({marks}) FOR UPDATE SKIP LOCKED", ids)
        return sorted(row[0] for row in cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_an_open_claim_locks_only_the_tasks_it_takes(queue: str) -> None:
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("no row locks to skip here (SQLite: one writer at a time)")
    cfg = cfg_with()
    ids = [t.pk for t in taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(50)])]
    other = connections.create_connection("default")
    other.set_autocommit(False)
    try:
        with transaction.atomic():
            claimed = {t.id for t in claim_batch(cfg, 10, "w1")}
            assert len(claimed) == 10  # (tasks of one enqueue_many share a due time: any 10 of them)
            assert lockable(other, ids) == sorted(set(ids) - claimed)
    finally:
        other.rollback()
        other.close()


@pytest.mark.django_db(transaction=True)
def test_a_claim_passes_over_a_head_locked_by_another_claim(queue: str) -> None:
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("no row locks to skip here (SQLite: one writer at a time)")
    cfg = cfg_with()
    # Due times a millisecond apart: the queue's order is theirs, not how the database breaks ties.
    start = timezone.now() - timedelta(minutes=1)
    specs = [
        {"task_type": T, "payload": {"i": i}, "run_after": start + timedelta(milliseconds=i)} for i in range(HEAD + 30)
    ]
    ids = [t.pk for t in taskflow.enqueue_many(specs)]
    other = connections.create_connection("default")
    other.set_autocommit(False)
    try:
        # Another worker's claim, still open: it holds the first HEAD rows of the queue.
        with other.cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM {sql.task_table()} WHERE status = %s AND task_type = %s "
                f"ORDER BY order_time LIMIT {HEAD} FOR UPDATE",
                [Status.PENDING.value, T],
            )
            assert len(cursor.fetchall()) == HEAD
        with transaction.atomic():
            assert [t.id for t in claim_batch(cfg, 10, "w1")] == ids[HEAD : HEAD + 10]
            assert lockable(other, ids[HEAD:]) == ids[HEAD + 10 :]
    finally:
        other.rollback()
        other.close()


@pytest.mark.django_db
def test_a_claim_starts_an_attempt_with_a_new_fencing_token() -> None:
    cfg = cfg_with(max_processing_time=120, max_retry_num=4)
    task = taskflow.enqueue(T, {"x": 1}, key="k", version=2, stage="s", context={"c": 1})
    custom = taskflow.enqueue(T, timeout=30, max_retries=0)
    now = timezone.now()

    claimed = {t.id: t for t in claim_batch(cfg, 10, "host:1:abc", now=now)}

    held = claimed[task.pk]
    assert (held.payload, held.key, held.version, held.stage, held.context) == ({"x": 1}, "k", 2, "s", {"c": 1})
    assert (held.attempt, held.lease_token, held.worker_id) == (1, 1, "host:1:abc")
    assert (held.timeout, held.max_retries) == (120, 4)  # the type's defaults apply when the task has none
    assert held.lease_expires_at == now + timedelta(seconds=120)
    assert (claimed[custom.pk].timeout, claimed[custom.pk].max_retries) == (30, 0)
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.attempts, row.lease_token, row.worker_id) == (Status.PROCESSING, 1, 1, "host:1:abc")
    assert row.lease_expires_at == held.lease_expires_at and row.started_at == now

    # Claimed again after being put back, the token moves on.
    Task.objects.filter(pk=task.pk).update(status=Status.PENDING)
    again = claim_batch(cfg, 10, "w2")
    assert [(t.id, t.attempt, t.lease_token) for t in again] == [(task.pk, 2, 2)]


@pytest.mark.django_db
def test_exact_limit_counts_tasks_already_running() -> None:
    cfg = cfg_with()
    for _ in range(5):
        taskflow.enqueue(T)
    assert len(claim_batch(cfg, 2, "w1", exact_limit=3)) == 2
    assert len(claim_batch(cfg, 10, "w2", exact_limit=3)) == 1
    assert claim_batch(cfg, 10, "w3", exact_limit=3) == []
    assert Task.objects.filter(status=Status.PROCESSING).count() == 3


@pytest.mark.django_db
def test_a_preferred_host_gets_its_task_until_the_preference_expires() -> None:
    cfg = cfg_with()
    now = timezone.now()
    task = taskflow.enqueue(T, run_after=now - timedelta(seconds=1))
    Task.objects.filter(pk=task.pk).update(prefer_host="alpha", prefer_host_until=now + timedelta(seconds=30))

    assert claim_batch(cfg, 5, "w-beta", host="beta", now=now) == []
    assert claim_batch(cfg, 5, "w-anon", now=now) == []
    assert [t.id for t in claim_batch(cfg, 5, "w-beta", host="beta", now=now + timedelta(seconds=31))] == [task.pk]


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_never_share_a_task() -> None:
    cfg_with()
    taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(300)])
    claimed: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def claimer(n: int) -> None:
        try:
            cfg = configs.get(T)
            barrier.wait(timeout=30)
            while batch := claim_batch(cfg, 7, f"w{n}"):
                claimed[n].extend(t.id for t in batch)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert errors == []
    every = [i for ids in claimed for i in ids]
    assert len(every) == len(set(every)) == 300
    assert Task.objects.filter(status=Status.PROCESSING, attempts=1, lease_token=1).count() == 300
    by_worker = dict(Task.objects.values_list("id", "worker_id"))
    assert all(by_worker[i] == f"w{n}" for n, ids in enumerate(claimed) for i in ids)


@pytest.mark.django_db
def test_a_live_worker_hands_back_only_the_attempts_it_does_not_hold() -> None:
    """rescue.hand_back_unheld: what a claim whose answer was lost left under a worker that still beats."""
    cfg = cfg_with()
    taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(6)])
    started = claim_batch(cfg, 2, "w1")  # started by the claim
    reserved = claim_batch(cfg, 0, "w1", reserve=2)  # claimed ahead, not started
    others = claim_batch(cfg, 2, "w2")
    kept, lost_started = started
    lost_reserved, kept_reserved = reserved
    held = [(kept.id, kept.lease_token), (kept_reserved.id, kept_reserved.lease_token)]

    assert hand_back_unheld("w1", held) == 2

    rows = Task.objects.in_bulk()
    for task in (lost_started, lost_reserved):
        row = rows[task.id]
        assert (row.status, row.attempts, row.worker_id, row.started_at) == (Status.PENDING, 0, "", None)
        # A late report of the lost claim is refused (it is guarded on `processing` and its token).
        assert row.lease_token == task.lease_token
    for task in (kept, kept_reserved, *others):
        row = rows[task.id]
        assert (row.status, row.attempts, row.lease_token) == (Status.PROCESSING, 1, task.lease_token)
    assert rows[kept_reserved.id].started_at is None and rows[kept.id].started_at is not None
    # Nothing more to hand back; and nothing of another worker's, whatever is listed.
    assert hand_back_unheld("w1", held) == 0
    assert Task.objects.filter(status=Status.PENDING).count() == 2
