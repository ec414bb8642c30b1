"""Redis names: every key and channel carries the deployment's namespace, so deployments sharing a server stay apart."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from taskflow.engine import locks, wakeup
from taskflow.engine.limiter import Limiter
from taskflow.engine.redis import derive_namespace, key, namespace
from taskflow.runtime.leadership import LEADER_LOCK

from .conftest import wait_until

Deployment = Callable[[str], AbstractContextManager[None]]


def test_keys_and_the_wakeup_channel_carry_the_configured_namespace() -> None:
    with override_settings(TASKFLOW={**settings.TASKFLOW, "REDIS_NAMESPACE": "shop-prod"}):
        assert key("lock", "taskwatch") == "taskflow:shop-prod:lock:taskwatch"
        assert wakeup.channel() == "taskflow:shop-prod:wakeup"


@pytest.mark.django_db
def test_the_default_namespace_is_derived_from_the_database_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test runner renamed the database after settings were loaded: the namespace follows it, so
    # tests never share keys with a deployment on the same Redis (as a name taken at import would).
    db = connection.settings_dict
    assert namespace() == derive_namespace(connection.vendor, db["HOST"], db["PORT"], db["NAME"])
    assert key("wakeup") == f"taskflow:{namespace()}:wakeup" == wakeup.channel()
    test_namespace = namespace()
    monkeypatch.setitem(connection.settings_dict, "NAME", f"{db['NAME']}_other")
    assert namespace() != test_namespace


def test_processes_that_spell_one_database_differently_share_its_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    same = derive_namespace("mysql", "DB.example.com", 3306, "shop")
    assert derive_namespace("mysql", "db.example.com", "", "shop") == same
    assert derive_namespace("postgresql", "db.example.com", "", "shop") != same
    assert derive_namespace("mysql", "db.example.com", 3307, "shop") != same
    assert derive_namespace("mysql", "db.example.com", 3306, "shop_test") != same
    monkeypatch.chdir("/tmp")
    relative = derive_namespace("sqlite", "", "", "var/db.sqlite3")
    assert relative == derive_namespace("sqlite", "", "", "/tmp/var/db.sqlite3")


# -- two deployments on one Redis --------------------------------------------------------------------


@pytest.fixture(params=["configured", "derived"])
def deployment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Deployment:
    """Act as deployment "a" or "b" on the same Redis: by REDIS_NAMESPACE, or by database name."""

    @contextmanager
    def act_as(name: str) -> Iterator[None]:
        if request.param == "configured":
            with override_settings(TASKFLOW={**settings.TASKFLOW, "REDIS_NAMESPACE": f"deployment-{name}"}):
                yield
        else:
            # The connection of this test stays open, so only the name changes (nothing reconnects).
            with monkeypatch.context() as patch:
                patch.setitem(connection.settings_dict, "NAME", f"{connection.settings_dict['NAME']}-{name}")
                yield

    return act_as


@pytest.mark.django_db
def test_two_deployments_share_no_leases(redis_client, deployment: Deployment) -> None:  # noqa: ANN001
    # (Id nodes are leased in the database, not in Redis: see tests/test_ids.py.)
    with deployment("a"):
        assert locks.acquire(LEADER_LOCK, "watcher-a", 30)
        assert locks.acquire("some-lease", "process-a", 30)
    with deployment("b"):
        assert locks.holder(LEADER_LOCK) is None
        assert locks.acquire(LEADER_LOCK, "watcher-b", 30)
        assert locks.acquire("some-lease", "process-b", 30)
    with deployment("a"):
        assert locks.holder(LEADER_LOCK) == "watcher-a"
        assert locks.holder("some-lease") == "process-a"


@pytest.mark.django_db
def test_two_deployments_share_no_concurrency_counters(redis_client, deployment: Deployment) -> None:  # noqa: ANN001
    limiter = Limiter(redis_client)
    with deployment("a"):
        assert limiter.take("t.limited", 5, 3).slots == 3
        assert limiter.take("t.limited", 5, 3).slots == 0  # a's limit is used up...
    with deployment("b"):
        assert limiter.take("t.limited", 5, 3).slots == 3  # ...and b's is its own


@pytest.mark.django_db
def test_two_deployments_share_no_wakeups(redis_client, deployment: Deployment) -> None:  # noqa: ANN001
    heard: list[set[str]] = []
    subscribed = threading.Event()

    def on_wakeup(types: set[str]) -> None:
        if types:
            heard.append(types)
        else:  # the listener looks once right after subscribing
            subscribed.set()

    stop = threading.Event()
    with deployment("a"):
        listener = threading.Thread(target=wakeup.RedisListener(on_wakeup, stop).listen, daemon=True)
        listener.start()
        assert subscribed.wait(10)
    try:
        with deployment("b"):
            # Published synchronously here (the publisher thread would name its channel later).
            receivers = redis_client.publish(wakeup.channel(), "t.from-b")
        assert receivers == 0
        with deployment("a"):
            assert redis_client.publish(wakeup.channel(), "t.from-a") == 1
        wait_until(lambda: heard, timeout=10)
        assert heard == [{"t.from-a"}]
    finally:
        stop.set()
        listener.join(timeout=10)


@pytest.mark.django_db
def test_a_wakeup_survives_its_publisher_connection_being_killed(redis_client) -> None:  # noqa: ANN001
    """The publisher keeps one connection; when Redis drops it, the next wake-up goes out on a new one, not lost."""
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(wakeup.channel())
    wait_until(lambda: redis_client.pubsub_numsub(wakeup.channel())[0][1] == 1, timeout=10)

    def next_message() -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.2)
            if message is not None:
                return message["data"].decode()
        raise AssertionError("no wake-up arrived within 10s")

    try:
        wakeup.publish({"t.first"})
        assert next_message() == "t.first"
        # Redis drops the publisher's connection (as a restart or an idle timeout would).
        held = [c for c in redis_client.client_list() if c["name"] == wakeup.publisher_name()]
        assert len(held) == 1
        redis_client.client_kill_filter(_id=held[0]["id"])
        wakeup.publish({"t.after-kill"})
        assert next_message() == "t.after-kill"
    finally:
        pubsub.close()


@pytest.mark.django_db
def test_a_wakeup_goes_out_where_redis_refuses_to_name_the_connection(redis_client, monkeypatch) -> None:  # noqa: ANN001
    """Naming the publisher's connection is best effort: a server that refuses CLIENT SETNAME still gets wake-ups."""
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(wakeup.channel())
    wait_until(lambda: redis_client.pubsub_numsub(wakeup.channel())[0][1] == 1, timeout=10)
    # Redis refuses a name with spaces ("ERR Client names cannot contain spaces ..."), as a proxy might refuse it.
    monkeypatch.setattr(wakeup, "publisher_name", lambda: "not a valid name")
    # The next message needs a new connection: drop this process's held one, if any.
    for client in redis_client.client_list():
        if client["name"] == f"taskflow-wakeups-{os.getpid()}":
            redis_client.client_kill_filter(_id=client["id"])
    try:
        wakeup.publish({"t.unnamed"})
        deadline = time.monotonic() + 10
        message = None
        while message is None and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.2)
        assert message is not None and message["data"].decode() == "t.unnamed"
    finally:
        pubsub.close()
