"""Ids stay unique: across fork, short-lived processes, crashes, a Redis flush and clock steps."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from taskflow.conf import get_settings
from taskflow.engine import ids, nodes
from taskflow.engine.ids import IdGenerator, NodeLease, node_of
from taskflow.models import IdNode, Task

from .conftest import REPO

INF = float("inf")


class OneNodeAtATime:
    """A node store in memory: hands out nodes 1, 2, 3... and counts what it is asked."""

    def __init__(self, valid_for: float = INF) -> None:
        self.valid_for = valid_for
        self.next_node = 1
        self.calls: list[str] = []
        self.renewal: Callable[[NodeLease, int], NodeLease | None] = lambda lease, up_to: None

    def acquire(self, from_ms: int) -> NodeLease:
        self.calls.append("acquire")
        self.next_node += 1
        now = ids.time.monotonic()
        return NodeLease(self.next_node - 1, 0, from_ms + 10_000, now + self.valid_for / 2, now + self.valid_for)

    def renew(self, lease: NodeLease, up_to_ms: int) -> NodeLease | None:
        self.calls.append("renew")
        return self.renewal(lease, up_to_ms)

    def release(self, lease: NodeLease, last_ms: int) -> None:
        self.calls.append("release")

    def forget(self, lease: NodeLease) -> None:
        self.calls.append("forget")


# ---------------------------------------------------------------- the generator


def test_a_clock_stepped_back_does_not_repeat_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_800_000_000_000]
    monkeypatch.setattr(ids, "_wall_ms", lambda: clock[0])
    gen = IdGenerator(OneNodeAtATime())
    minted = gen.next_ids(5000)
    clock[0] -= 5000  # NTP steps the clock back five seconds
    minted += [gen.next_id() for _ in range(5000)]
    assert minted == sorted(minted) and len(set(minted)) == len(minted)


def test_minting_asks_the_node_store_once_not_per_id() -> None:
    store = OneNodeAtATime()
    gen = IdGenerator(store)
    for _ in range(200):
        gen.next_ids(500)
    for _ in range(20_000):
        gen.next_id()
    assert store.calls == ["acquire"]


def test_a_lease_that_may_have_lapsed_is_not_minted_under(monkeypatch: pytest.MonkeyPatch) -> None:
    store = OneNodeAtATime(valid_for=60)
    gen = IdGenerator(store)
    assert node_of(gen.next_id()) == 1
    clock = [ids.time.monotonic()]
    monkeypatch.setattr(ids.time, "monotonic", lambda: clock[0])

    def unreachable(lease: NodeLease, up_to: int) -> NodeLease | None:
        raise ConnectionError("database down")

    store.renewal = unreachable
    clock[0] += 31  # time to renew, and the renewal fails: the lease is still good for a while
    assert {node_of(i) for i in gen.next_ids(100) + [gen.next_id() for _ in range(100)]} == {1}
    assert store.calls == ["acquire", "renew"]  # one failing round trip, not one per id
    clock[0] += 30  # now it may have lapsed
    with pytest.raises(ConnectionError):
        gen.next_id()  # the node may be someone else's by now: no id rather than a duplicate
    store.renewal = lambda lease, up_to: None  # the store says: lost
    assert node_of(gen.next_id()) == 2
    assert store.calls == ["acquire", "renew", "renew", "renew", "acquire"]


def test_a_new_lease_starts_above_the_previous_holders_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ids, "_wall_ms", lambda: 1_800_000_000_000)
    store = OneNodeAtATime()
    store.acquire = lambda from_ms: NodeLease(7, 1_800_000_060_000, 1_800_000_070_000, INF, INF)
    minted = IdGenerator(store).next_ids(3)
    assert [ids.timestamp_ms(i) for i in minted] == [1_800_000_060_001] * 3


# ---------------------------------------------------------------- settings


def test_a_fixed_node_id_setting_is_refused() -> None:
    with override_settings(TASKFLOW={"NODE_ID": 3}), pytest.raises(ImproperlyConfigured, match="NODE_ID.*same ids"):
        get_settings()


# ---------------------------------------------------------------- the node stores (this database's)


def other_node() -> int:
    """A node no process holds, to aim two holders at."""
    held = leased_nodes() | {lease.node for lease in [ids.current_lease()] if lease}
    return next(n for n in range(777, 1024) if n not in held)


def leased_nodes() -> set[int]:
    """Nodes leased now by any process but this test process's own generator."""
    own = ids.current_lease()
    if connection.vendor == "sqlite":
        held = set()
        for path in nodes._node_folder().glob("*.lock"):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.add(int(path.stem))
            finally:
                os.close(fd)
    else:
        live = IdNode.objects.filter(expires_at__gt=nodes.DatabaseNow()).exclude(owner="")
        held = set(live.values_list("node", flat=True))
    return held - ({own.node} if own else set())


def aim_at(monkeypatch: pytest.MonkeyPatch, node: int) -> None:
    monkeypatch.setattr(nodes.random, "randint", lambda a, b: node)


@pytest.mark.parametrize("previous_holder", ["released", "crashed"])
def test_the_next_holder_of_a_node_mints_above_the_previous_one(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch, previous_holder: str
) -> None:
    node = other_node()
    aim_at(monkeypatch, node)
    clock = [1_800_000_000_000]
    monkeypatch.setattr(ids, "_wall_ms", lambda: clock[0])
    first = IdGenerator(nodes.node_source())
    before = first.next_ids(5000)  # 5,000 ids in one millisecond spill into the next
    if previous_holder == "released":
        first.release()
    else:  # the process died without giving its node back
        if connection.vendor == "sqlite":
            os.close(first.lease.token)  # the kernel drops its lock
        else:
            IdNode.objects.filter(node=node).update(expires_at=nodes.DatabaseNow())  # its lease ran out
        first._lease = None
    clock[0] -= 1  # the clock was stepped back: the new holder's clock says what the old one's did
    second = IdGenerator(nodes.node_source())
    after = second.next_ids(5000)
    second.release()
    assert {node_of(i) for i in before + after} == {node}
    assert min(after) > max(before)


def test_a_lease_in_use_is_never_granted_to_another_owner(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = other_node()
    aim_at(monkeypatch, node)
    store = nodes.node_source()
    held = store.acquire(ids._wall_ms())
    assert held.node == node
    # A host whose clock runs two days fast still sees the lease as taken: the database's clock rules.
    fast = datetime.now(UTC) + timedelta(days=2)
    with monkeypatch.context() as m:
        m.setattr(ids.time, "time", lambda: fast.timestamp())
        m.setattr(timezone, "now", lambda: fast)
        other = store.acquire(ids._wall_ms())
    assert other.node != node
    store.release(other, other.floor_ms)
    store.release(held, held.floor_ms)
    again = store.acquire(ids._wall_ms())
    store.release(again, again.floor_ms)
    assert again.node == node  # given back: free again


def test_a_holder_that_lost_its_lease_cannot_renew_it(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if connection.vendor == "sqlite":
        pytest.skip("on SQLite a node is a lock file the kernel holds until its process dies")
    node = other_node()
    aim_at(monkeypatch, node)
    store = nodes.DatabaseNodes()
    first = store.acquire(ids._wall_ms())
    IdNode.objects.filter(node=node).update(expires_at=nodes.DatabaseNow())  # ran out while it was stalled
    second = store.acquire(ids._wall_ms())
    assert second.node == node and second.floor_ms == first.limit_ms
    assert store.renew(first, first.limit_ms + 1) is None
    store.release(first, first.floor_ms)  # matches nothing: the node stays the second holder's
    assert IdNode.objects.get(node=node).owner == second.token


def test_a_database_beside_this_one_never_takes_its_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """./scripts/run's database (var/taskflow.sqlite3) holding nodes leaves the test database's free."""
    if connection.vendor != "sqlite":
        pytest.skip("IdNode rows live in their own database already")
    this = Path(str(connection.settings_dict["NAME"]))
    beside = this.with_name("taskflow.sqlite3" if this.name != "taskflow.sqlite3" else "other.sqlite3")
    folder = nodes._node_folder(str(beside))
    folder.mkdir(parents=True, exist_ok=True)
    held = []
    try:
        # Every node the tests above aim at, held by processes of the other database.
        for node in range(777, 1024):
            fd = os.open(folder / f"{node}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            held.append(fd)
            with contextlib.suppress(BlockingIOError):  # a real process on that database holds it: as good
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        node = other_node()
        aim_at(monkeypatch, node)
        store = nodes.node_source()
        lease = store.acquire(ids._wall_ms())
        store.release(lease, lease.floor_ms)
        assert lease.node == node
    finally:
        for fd in held:
            os.close(fd)


# ---------------------------------------------------------------- real processes


def run(env: dict[str, str], *args: str, stdin: str = "") -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.idprocs", *args],
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.processes
def test_forked_children_mint_under_nodes_of_their_own(process_env: dict[str, str], tmp_path: Path) -> None:
    [result] = run(process_env, "fork", "4", "1000", str(tmp_path))
    assert result["codes"] == [0, 0, 0, 0]  # no IntegrityError in any child
    children = [json.loads((tmp_path / f"child-{i}.json").read_text()) for i in range(4)]
    minted = result["parent"] + [i for child in children for i in child]
    assert len(set(minted)) == len(minted) == 4001
    assert Task.objects.count() == 4001
    node_sets = [{node_of(i) for i in result["parent"]}] + [{node_of(i) for i in child} for child in children]
    assert all(len(s) == 1 for s in node_sets) and len(set.union(*node_sets)) == 5


@pytest.mark.processes
def test_short_lived_processes_give_their_nodes_back(process_env: dict[str, str]) -> None:
    node = other_node()
    # Every process tries the same node first: each gets it only if the one before gave it back.
    forked = run(process_env, "sequential", "50", "--node", str(node))
    started = [line for _ in range(3) for line in run(process_env, "mint", "1", "--node", str(node))]
    assert not [line for line in forked if "error" in line]
    minted = [i for line in forked + started for i in line["ids"]]
    assert len(forked) == 50 and len(started) == 3
    assert {node_of(i) for i in minted} == {node}
    assert len(set(minted)) == Task.objects.count() == 53
    assert leased_nodes() == set()


@pytest.mark.processes
def test_a_crashed_holders_node_is_reused_only_above_its_ids(process_env: dict[str, str]) -> None:
    node = other_node()
    lines = run(process_env, "crash", "2", "60", "--node", str(node))
    minted = {line["child"]: line["ids"] for line in lines}
    crashed, at_once, after_ttl = minted["crashed"], minted["at-once"], minted["after-ttl"]
    assert {node_of(i) for i in crashed} == {node}
    if connection.vendor == "sqlite":
        assert node_of(at_once[0]) == node  # the kernel freed the dead process's lock at once
    else:
        assert node_of(at_once[0]) != node  # its lease had not run out yet
    assert node_of(after_ttl[0]) == node
    # The crashed process's clock ran a minute fast: who takes its node still mints above its ids.
    for later in (at_once, after_ttl):
        if node_of(later[0]) == node:
            assert min(later) > max(crashed)
    every = crashed + at_once + after_ttl
    assert len(set(every)) == Task.objects.count() == len(every)


@pytest.mark.processes
def test_a_pool_forked_after_enqueueing_mints_unique_ids_and_gives_nodes_back(process_env: dict[str, str]) -> None:
    [result] = run(process_env, "pool", "2", "8")
    parent_node = node_of(result["parent"][0])
    minted = result["parent"] + [i for _, got in result["results"] for i in got]
    assert len(set(minted)) == Task.objects.count() == 1 + 8 * 20
    for _, got in result["results"]:
        assert len({node_of(i) for i in got}) == 1 and node_of(got[0]) != parent_node
    assert leased_nodes() == set()


@pytest.mark.processes
def test_a_redis_flush_does_not_give_a_live_processes_node_to_another(
    process_env: dict[str, str],
    redis_client,  # noqa: ANN001
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.idprocs", "hold", "1000"],
        cwd=REPO,
        env=process_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(holder.stdout.readline())
        node = node_of(first["ids"][0])
        redis_client.flushdb()
        [second] = run(process_env, "mint", "1000", "--node", str(node))
        out, _ = holder.communicate("go\n", timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert holder.returncode == 0
    assert node_of(second["ids"][0]) != node
    minted = first["ids"] + json.loads(out)["ids"] + second["ids"]
    assert len(set(minted)) == Task.objects.count() == 2001
