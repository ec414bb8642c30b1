"""Enqueueing: validation, the identity and version rules, atomicity, and concurrent duplicates."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import taskflow
from taskflow.engine import ids, sql, wakeup
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.models import ScheduleCfg, Status, Task, TaskKey

from .conftest import exit_status, wait_until

T = "test.noop"


def snapshot() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every task and identity row, to prove a refused call changed nothing."""
    tasks = list(Task.objects.order_by("id").values())
    # TaskKey.updated_at is touched by every keyed call: it is how the identity lock is taken.
    keys = list(TaskKey.objects.order_by("task_type", "key").values("task_type", "key", "version"))
    return tasks, keys


def set_status(task: Task, status: str, **extra: Any) -> None:
    Task.objects.filter(pk=task.pk).update(status=status, **extra)


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("task_type", "payload", "options"),
    [
        ("", {}, {}),
        ("9starts.with.digit", {}, {}),
        ("has space", {}, {}),
        ("x" * 101, {}, {}),
        (None, {}, {}),
        (T, {}, {"priority": -101}),
        (T, {}, {"priority": 101}),
        (T, {}, {"priority": True}),
        (T, {}, {"priority": "1"}),
        (T, {}, {"priority": 1.5}),
        (T, {1, 2}, {}),
        (T, object(), {}),
        (T, {"nan": float("nan")}, {}),
        (T, {(1, 2): "tuple key"}, {}),
        (T, {}, {"key": 5}),
        (T, {}, {"key": "k" * 256}),
        (T, {}, {"key": "k", "version": -1}),
        (T, {}, {"key": "k", "version": "2"}),
        (T, {}, {"key": "k", "version": 2**63}),
        (T, {}, {"max_retries": -1}),
        (T, {}, {"max_retries": 2**40}),
        (T, {}, {"timeout": 0}),
        (T, {}, {"timeout": 2**40}),
        (T, {}, {"run_after": datetime(2030, 1, 1)}),  # noqa: DTZ001 - naive on purpose
        (T, {}, {"run_after": "tomorrow"}),
        (T, {}, {"context": {"s": {1}}}),
        (T, {}, {"stage": 5}),
        (T, {}, {"trace_id": "t" * 33}),
    ],
)
def test_malformed_requests_are_refused_and_write_nothing(task_type: Any, payload: Any, options: dict) -> None:
    with pytest.raises(taskflow.InvalidTask):
        taskflow.enqueue(task_type, payload, **options)
    assert not Task.objects.exists()
    assert not TaskKey.objects.exists()
    assert not ScheduleCfg.objects.exists()


@pytest.mark.django_db
def test_an_unknown_option_is_refused_and_writes_nothing() -> None:
    with pytest.raises(TypeError):  # a call-site mistake: enqueue has a fixed signature
        taskflow.enqueue(T, {}, colour="red")  # type: ignore[call-arg]
    with pytest.raises(taskflow.InvalidTask, match="colour"):  # request data: a clear error
        taskflow.enqueue_many([{"task_type": T, "payload": {}, "colour": "red"}])
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_enqueue_many_refuses_the_whole_batch_for_one_malformed_item() -> None:
    with pytest.raises(taskflow.InvalidTask):
        taskflow.enqueue_many([{"task_type": T}, {"task_type": T, "key": "a"}, {"task_type": T, "payload": {1}}])
    with pytest.raises(taskflow.InvalidTask, match="task_type is required"):
        taskflow.enqueue_many([{"task_type": T}, {"payload": {}}])
    assert not Task.objects.exists()
    assert not TaskKey.objects.exists()
    assert not ScheduleCfg.objects.exists()


@pytest.mark.django_db
def test_a_valid_request_is_stored_as_given() -> None:
    run_after = timezone.now() + timedelta(minutes=5)
    task = taskflow.enqueue(
        T,
        {"a": [1, 2]},
        key="k1",
        version=3,
        priority=-7,
        run_after=run_after,
        max_retries=4,
        timeout=60,
        stage="s1",
        user_id=42,
        context={"c": 1},
        trace_id="abc",
    )
    assert task.enqueue_outcome == "created"
    row = Task.objects.get(pk=task.pk)
    assert (row.task_type, row.key, row.version, row.priority) == (T, "k1", 3, -7)
    assert (row.payload, row.context, row.stage, row.trace_id) == ({"a": [1, 2]}, {"c": 1}, "s1", "abc")
    assert row.user_id == "42"
    assert (row.max_retries, row.timeout, row.status, row.attempts) == (4, 60, Status.PENDING, 0)
    assert row.run_after == run_after
    assert TaskKey.objects.get(task_type=T, key="k1").version == 3


# Values Python calls equal but JSON and the database do not: each must come back as it went in.
EQUAL_BUT_DIFFERENT = [[True, 1, 1.0], [False, 0, 0.0]]


def as_stored(value: Any) -> str:
    """The JSON text of a value: tells True, 1 and 1.0 apart, unlike ==."""
    return json.dumps(value)


@pytest.mark.django_db
@pytest.mark.parametrize("values", EQUAL_BUT_DIFFERENT)
def test_bulk_enqueue_stores_equal_but_differently_typed_values_exactly(values: list[Any]) -> None:
    shapes = [lambda v: {"flag": v}, lambda v: {"deep": [{"x": v}, v]}, lambda v: [v]]
    for shape in shapes:
        payloads = [shape(v) for v in values]
        tasks = taskflow.enqueue_many([{"task_type": T, "payload": p, "context": {"c": p}} for p in payloads])
        stored = {t.pk: (t.payload, t.context) for t in Task.objects.filter(pk__in=[t.pk for t in tasks])}
        for task, payload in zip(tasks, payloads, strict=True):
            assert as_stored(stored[task.pk]) == as_stored((payload, {"c": payload}))
            assert as_stored(task.payload) == as_stored(payload)


def test_db_defaults_are_the_model_defaults() -> None:
    # The INSERT leaves out a column whose value is its db_default: the database must then store
    # exactly what the ORM would have sent.
    with_db_default = [f for f in Task._meta.concrete_fields if f.has_db_default()]
    assert {f.name for f in with_db_default} >= {"status", "context", "schedule_log", "attempts", "lease_token"}
    for f in with_db_default:
        db_default = getattr(f.db_default, "value", f.db_default)
        python_default = f.get_default()
        if f.get_internal_type() == "JSONField":
            assert json.loads(db_default) == python_default and type(json.loads(db_default)) is type(python_default)
        else:
            assert sql._text_to_db(db_default) == sql._text_to_db(python_default), f.name


def stored_row(pk: int) -> dict[str, Any]:
    return {k: v for k, v in Task.objects.filter(pk=pk).values().get().items() if k not in ("id", "trace_id")}


@pytest.mark.django_db
@pytest.mark.parametrize("count", [1, 3])
def test_columns_left_to_their_db_default_read_back_as_the_orm_writes_them(count: int) -> None:
    now = timezone.now()
    tasks = taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}, "run_after": now} for i in range(count)])
    for i, task in enumerate(tasks):
        orm = Task.objects.create(
            task_type=T,
            payload={"i": i},
            run_after=now,
            order_time=now,
            created_at=task.created_at,
            updated_at=task.updated_at,
        )
        assert stored_row(task.pk) == stored_row(orm.pk)


@pytest.mark.django_db
@pytest.mark.parametrize("count", [1, 2])
def test_values_beside_a_db_default_are_stored_as_given(count: int) -> None:
    # Each differs from its column's default in type or by a hair: none may be left to the database.
    options = {
        "context": {"": 0},
        "stage": " ",
        "user_id": "0",
        "priority": 1,
        "version": 1,
        "retry_same_host": 1,
        "key": "k",  # a lone keyed request per type
    }
    for name, value in options.items():
        requests = [{"task_type": f"{T}.{name}", "payload": {"i": i}, name: value} for i in range(count)]
        if name == "version":
            requests = [{**r, "key": f"v{i}"} for i, r in enumerate(requests)]
        for task in taskflow.enqueue_many(requests):
            row = Task.objects.get(pk=task.pk)
            assert as_stored(getattr(row, name)) == as_stored(value), name
    mixed = taskflow.enqueue_many([{"task_type": T, "payload": {}, "context": c} for c in ({}, {"a": 1}, {"": []}, {})])
    assert [as_stored(Task.objects.get(pk=t.pk).context) for t in mixed] == ["{}", '{"a": 1}', '{"": []}', "{}"]


# -- identity and versions -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("status", [Status.PENDING, Status.PROCESSING, Status.SUCCESS])
def test_same_identity_while_live_or_done_returns_the_existing_task_unchanged(status: str) -> None:
    first = taskflow.enqueue(T, {"n": 1}, key="k", version=2, priority=5)
    if status == Status.PROCESSING:
        assert [c.id for c in claim_batch(configs.get(T), 10, "w1")] == [first.pk]
    elif status != Status.PENDING:
        set_status(first, status)
    before = snapshot()

    again = taskflow.enqueue(T, {"n": 2}, key="k", version=2, priority=-5)

    assert again.enqueue_outcome == "existing"
    assert again.pk == first.pk
    assert again.status == status and again.payload == {"n": 1} and again.priority == 5
    assert snapshot() == before


@pytest.mark.django_db
@pytest.mark.parametrize("status", [Status.FAILED, Status.STOPPED])
def test_same_identity_after_failure_or_stop_is_replaced_by_a_fresh_pending_task(status: str) -> None:
    first = taskflow.enqueue(T, {"n": 1}, key="k", version=2, max_retries=1)
    set_status(first, status, attempts=2, status_msg="boom", result={"partial": True}, checkpoint={"at": 9})

    again = taskflow.enqueue(T, {"n": 2}, key="k", version=2, priority=9)

    assert again.enqueue_outcome == "replaced"
    assert again.pk == first.pk  # the row and its history are kept
    row = Task.objects.get(pk=first.pk)
    assert row.status == Status.PENDING
    assert (row.attempts, row.payload, row.priority, row.max_retries) == (0, {"n": 2}, 9, None)
    assert row.result is None and row.checkpoint is None and row.finished_at is None
    assert f"was {status}" in row.status_msg
    assert Task.objects.count() == 1


@pytest.mark.django_db
def test_an_older_version_is_refused_and_changes_nothing() -> None:
    taskflow.enqueue(T, {"v": 3}, key="k", version=3)
    before = snapshot()

    with pytest.raises(taskflow.StaleVersion) as refused:
        taskflow.enqueue(T, {"v": 2}, key="k", version=2)

    assert (refused.value.version, refused.value.newest) == (2, 3)
    assert snapshot() == before


@pytest.mark.django_db
def test_a_newer_version_supersedes_only_older_pending_versions() -> None:
    v1 = taskflow.enqueue(T, {"v": 1}, key="k", version=1)
    assert [c.id for c in claim_batch(configs.get(T), 1, "w1")] == [v1.pk]  # v1 is now running
    taskflow.enqueue(T, {"v": 2}, key="k", version=2)
    v3 = taskflow.enqueue(T, {"v": 3}, key="k", version=3)
    v5 = taskflow.enqueue(T, {"v": 5}, key="k", version=5)

    rows = {t.version: t for t in Task.objects.filter(key="k")}
    # A running attempt is not interrupted (it is marked, see test_versions); waiting ones are stopped and say why.
    assert rows[1].status == Status.PROCESSING and rows[1].superseded_by == 5
    for version in (2, 3):
        assert rows[version].status == Status.STOPPED
        assert "superseded" in rows[version].status_msg
        assert rows[version].finished_at is not None
    assert rows[5].status == Status.PENDING and rows[5].pk == v5.pk
    assert v3.enqueue_outcome == "created"
    assert TaskKey.objects.get(task_type=T, key="k").version == 5

    # A superseded version cannot come back, even though it is stopped.
    with pytest.raises(taskflow.StaleVersion):
        taskflow.enqueue(T, {"v": 3}, key="k", version=3)


@pytest.mark.django_db
def test_a_repeat_in_the_same_microsecond_is_still_the_existing_task(monkeypatch: pytest.MonkeyPatch) -> None:
    # The identity's head row then gets the same timestamp twice: MySQL must still see an existing row.
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    first = taskflow.enqueue(T, {"n": 1}, key="k", version=1)
    again = taskflow.enqueue(T, {"n": 2}, key="k", version=1)
    assert (again.enqueue_outcome, again.pk, again.payload) == ("existing", first.pk, {"n": 1})
    with pytest.raises(taskflow.StaleVersion):
        taskflow.enqueue(T, key="k", version=0)


@pytest.mark.django_db
def test_a_new_key_takes_two_statements_and_a_repeat_a_few() -> None:
    def statements(**options: Any) -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            taskflow.enqueue(T, **options)
        return [q["sql"] for q in queries if "SAVEPOINT" not in q["sql"]]

    taskflow.enqueue(T, key="warm")  # the type's config row, cached from here on
    assert len(statements(key="new", version=1)) == 2  # the identity's head row, the task
    assert len(statements(key="new", version=1)) <= 4  # head, its version, the existing task
    assert len(statements(key="new", version=2)) <= 5  # ..., the new task, older versions superseded


@pytest.mark.django_db
def test_replacing_the_newest_version_stops_older_pending_ones() -> None:
    old = taskflow.enqueue(T, key="k", version=1)
    new = taskflow.enqueue(T, key="k", version=2)
    set_status(new, Status.FAILED)
    set_status(old, Status.PENDING)  # e.g. an operator retried it by hand
    assert taskflow.enqueue(T, key="k", version=2).enqueue_outcome == "replaced"
    assert Task.objects.get(pk=old.pk).status == Status.STOPPED


@pytest.mark.django_db
@pytest.mark.parametrize("key", [None, ""])
def test_without_a_key_every_call_creates_a_task(key: str | None) -> None:
    tasks = [taskflow.enqueue(T, {"same": True}, key=key) for _ in range(3)]
    assert {t.enqueue_outcome for t in tasks} == {"created"}
    assert len({t.pk for t in tasks}) == 3
    assert list(Task.objects.values_list("key", flat=True).distinct()) == [None]
    assert not TaskKey.objects.exists()


@pytest.mark.django_db
def test_the_same_key_under_two_types_is_two_identities() -> None:
    a = taskflow.enqueue("test.noop", key="shared", version=5)
    b = taskflow.enqueue("test.record", key="shared", version=1)
    assert a.pk != b.pk and b.enqueue_outcome == "created"
    assert Task.objects.get(pk=a.pk).status == Status.PENDING


@pytest.mark.django_db
def test_enqueue_many_is_all_or_nothing_when_one_item_is_stale() -> None:
    taskflow.enqueue(T, key="a", version=5)
    before = snapshot()

    with pytest.raises(taskflow.StaleVersion):
        taskflow.enqueue_many(
            [
                {"task_type": T, "payload": {"unkeyed": 1}},
                {"task_type": T, "key": "b", "version": 1},
                {"task_type": T, "key": "a", "version": 4},
            ]
        )

    assert snapshot() == before


@pytest.mark.django_db
def test_enqueue_many_splits_a_call_too_big_for_one_statement() -> None:
    # 20 MB in one call: more than a stock MariaDB takes in one statement (max_allowed_packet 16 MiB).
    big = "x" * 20_000
    tasks = taskflow.enqueue_many([{"task_type": T, "payload": {"i": i, "blob": big}} for i in range(1000)])
    assert len({t.pk for t in tasks}) == 1000
    assert Task.objects.filter(task_type=T).count() == 1000
    assert Task.objects.get(pk=tasks[999].pk).payload == {"i": 999, "blob": big}


@pytest.mark.django_db(transaction=True)
def test_a_call_split_into_several_statements_is_still_all_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sql, "INSERT_BYTES", 3 * sql.ROW_BYTES)  # two rows per statement
    minted = iter([101, 102, 103, 101])  # the last statement collides with the first one's row
    monkeypatch.setattr(ids, "next_ids", lambda count: [next(minted) for _ in range(count)])
    with pytest.raises(IntegrityError):
        taskflow.enqueue_many([{"task_type": T, "payload": {"i": i}} for i in range(4)])
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_enqueue_many_returns_outcomes_in_request_order() -> None:
    existing = taskflow.enqueue(T, key="m", version=1)
    tasks = taskflow.enqueue_many(
        [
            {"task_type": T, "key": "z", "version": 1},
            {"task_type": T, "payload": {"i": 1}},
            {"task_type": T, "key": "m", "version": 1},
            {"task_type": T, "key": "z", "version": 1},
            {"task_type": T, "payload": {"i": 2}},
        ]
    )
    assert [t.enqueue_outcome for t in tasks] == ["created", "created", "existing", "existing", "created"]
    assert tasks[0].pk == tasks[3].pk and tasks[2].pk == existing.pk
    assert [tasks[1].payload, tasks[4].payload] == [{"i": 1}, {"i": 2}]
    assert Task.objects.count() == 4
    assert taskflow.enqueue_many([]) == []


# -- transactions ----------------------------------------------------------------------------------


@pytest.fixture
def wakeups() -> Any:
    """The task types announced to workers, in order."""
    seen: list[set[str]] = []
    listener = seen.append
    wakeup.add_local_listener(listener)
    yield seen
    wakeup.remove_local_listener(listener)


class Boom(Exception):
    pass


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_leaves_no_task_no_identity_and_wakes_nobody(wakeups: list) -> None:
    with pytest.raises(Boom), transaction.atomic():
        taskflow.enqueue(T, {"n": 1}, key="k", version=1)
        taskflow.enqueue(T, {"n": 2})
        assert Task.objects.count() == 2
        raise Boom

    assert not Task.objects.exists()
    assert not TaskKey.objects.exists()
    assert wakeups == []
    # The same identity is free to be created afterwards.
    with transaction.atomic():
        assert taskflow.enqueue(T, key="k", version=1).enqueue_outcome == "created"
        assert wakeups == []  # workers hear of it only once it commits
    assert wakeups == [{T}]


@pytest.mark.django_db(transaction=True)
def test_a_refused_call_inside_a_transaction_keeps_the_callers_other_work(wakeups: list) -> None:
    taskflow.enqueue(T, key="k", version=2)
    with transaction.atomic():
        mine = taskflow.enqueue(T, {"mine": True})
        with pytest.raises(taskflow.StaleVersion):
            taskflow.enqueue_many([{"task_type": T, "payload": {"lost": True}}, {"task_type": T, "key": "k"}])
        with pytest.raises(taskflow.StaleVersion):
            taskflow.enqueue(T, {"lost": True}, key="k", version=1)  # a lone request: no savepoint needed
        also_mine = taskflow.enqueue(T, {"also mine": True}, key="other")
    payloads = list(Task.objects.values_list("payload", flat=True))
    assert len(payloads) == 3 and {"lost": True} not in payloads
    assert Task.objects.filter(pk__in=[mine.pk, also_mine.pk]).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_refused_call_outside_a_transaction_writes_nothing_and_leaves_autocommit_on() -> None:
    taskflow.enqueue(T, key="k", version=3)
    before = snapshot()
    with pytest.raises(taskflow.StaleVersion):
        taskflow.enqueue_many([{"task_type": T, "payload": {"lost": True}}, {"task_type": T, "key": "k", "version": 2}])
    assert snapshot() == before
    assert connection.get_autocommit() and not connection.in_atomic_block
    assert taskflow.enqueue(T, key="k", version=4).enqueue_outcome == "created"  # and it commits:
    assert Task.objects.filter(key="k", version=4).exists()


@pytest.mark.django_db
def test_tasks_due_later_or_already_there_wake_nobody(wakeups: list) -> None:
    taskflow.enqueue(T, run_after=timedelta(hours=1))
    first = taskflow.enqueue("test.record", key="k")
    with transaction.atomic():
        taskflow.enqueue("test.record", key="k")
    # The test's own transaction never commits, so nothing was announced at all.
    assert wakeups == []
    assert first.enqueue_outcome == "created"


# -- concurrency -----------------------------------------------------------------------------------


def run_concurrently(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run `work(i)` on `count` threads released together, each on its own DB connection."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def body(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = work(i)
        except Exception as exc:
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicates_create_exactly_one_task() -> None:
    results = run_concurrently(8, lambda i: taskflow.enqueue(T, {"thread": i}, key="dup", version=1))

    errors = [r for r in results if isinstance(r, Exception)]
    assert errors == []
    assert sorted(r.enqueue_outcome for r in results) == ["created"] + ["existing"] * 7
    assert len({r.pk for r in results}) == 1
    assert Task.objects.filter(task_type=T, key="dup").count() == 1
    assert TaskKey.objects.filter(task_type=T, key="dup").count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_enqueue_that_is_a_threads_first_query_works() -> None:
    """A web or worker thread's first database use may be an enqueue (the type's config cached)."""
    taskflow.enqueue(T)  # warms the config cache, so the threads' first query is the INSERT
    results = run_concurrently(4, lambda i: taskflow.enqueue(T, {"thread": i}))
    assert [r for r in results if isinstance(r, Exception)] == []
    assert Task.objects.filter(task_type=T).count() == 5


@pytest.mark.django_db(transaction=True)
def test_concurrent_versions_of_a_new_key_leave_one_live_newest_task() -> None:
    results = run_concurrently(8, lambda i: taskflow.enqueue(T, {"v": i + 1}, key="race", version=i + 1))

    unexpected = [r for r in results if isinstance(r, Exception) and not isinstance(r, taskflow.StaleVersion)]
    assert unexpected == []
    rows = list(Task.objects.filter(task_type=T, key="race"))
    live = [t for t in rows if t.status != Status.STOPPED]
    assert [(t.version, t.status) for t in live] == [(8, Status.PENDING)]
    assert all("superseded" in t.status_msg for t in rows if t.status == Status.STOPPED)
    # Every caller either got its task (maybe since superseded) or was told it was stale.
    for version, result in enumerate(results, start=1):
        if isinstance(result, taskflow.StaleVersion):
            assert result.newest > version
            assert not any(t.version == version for t in rows)
        else:
            assert result.version == version and any(t.pk == result.pk for t in rows)
    assert TaskKey.objects.get(task_type=T, key="race").version == 8


ENQUEUE_WHEN_RELEASED = """
import os, sys, time
import taskflow
ready, gate = os.environ["TF_READY"], os.environ["TF_GATE"]
open(ready, "w").close()
while not os.path.exists(gate):
    time.sleep(0.005)
task = taskflow.enqueue("test.noop", {"pid": os.getpid()}, key="proc-dup", version=1)
print("OUTCOME", task.enqueue_outcome, task.pk)
"""


@pytest.mark.processes
def test_concurrent_duplicates_from_separate_processes_create_exactly_one_task(spawn, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    procs = [
        spawn("shell", "-c", ENQUEUE_WHEN_RELEASED, env={"TF_READY": str(tmp_path / f"ready{i}"), "TF_GATE": str(gate)})
        for i in range(4)
    ]
    wait_until(lambda: all((tmp_path / f"ready{i}").exists() for i in range(4)), timeout=60)
    gate.touch()
    outcomes = []
    for proc in procs:
        assert exit_status(proc) == 0, Path(proc.log_path).read_text()
        lines = [line.split() for line in Path(proc.log_path).read_text().splitlines() if line.startswith("OUTCOME")]
        outcomes.append(tuple(lines[0][1:]))
    assert sorted(o[0] for o in outcomes) == ["created", "existing", "existing", "existing"]
    assert len({o[1] for o in outcomes}) == 1
    assert Task.objects.filter(key="proc-dup").count() == 1
