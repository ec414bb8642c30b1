"""Waking workers when work arrives: Redis pub/sub, else PostgreSQL's LISTEN/NOTIFY; in-process listeners always.

Wake-ups are a latency optimisation only; workers also poll, so a lost message delays a task by
at most one poll interval and never loses it. Operator stop notices travel the same way. A worker
starts whatever listener the deployment has with `start_listener`.

Without Redis on PostgreSQL, a wake-up is a NOTIFY sent on the database connection that wrote the
work, inside its transaction: PostgreSQL delivers it when that transaction commits (and never if
it rolls back), to every session that LISTENs, on any host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, OperationalError, connection, connections, transaction

from ..conf import get_settings
from .redis import RedisError, get_redis, key

log = logging.getLogger("taskflow.wakeup")
MERGE_WINDOW = 0.002  # seconds
# PostgreSQL channels (per database, so no namespace is needed). A payload must stay under 8000 bytes.
PG_WAKEUP, PG_STOP = "taskflow_wakeup", "taskflow_stop"
PG_PAYLOAD_MAX = 7900
Listener = Callable[[set[str]], None]
_local: list[Listener] = []


def channel() -> str:
    """The pub/sub channel of this deployment's wake-ups (named when used: see redis.namespace)."""
    return key("wakeup")


def notify_on_commit(task_types: Iterable[str], *, by_database: bool = True) -> None:
    """Wake workers for these types once the surrounding transaction commits (now, if none).

    `by_database=False`: the caller has already sent the database's notice (see notification).
    """
    types = set(task_types)
    if types:
        transaction.on_commit(lambda: publish(types, by_database=by_database))


def publish(task_types: set[str], *, by_database: bool = True) -> None:
    """Wake workers for these types now (a NOTIFY inside a transaction goes out when it commits)."""
    for listener in list(_local):
        listener(task_types)
    if get_settings().REDIS_ALIAS:
        _publisher.send(task_types)
    elif by_database:
        _notify(notification(task_types))


def by_database() -> bool:
    """Whether wake-ups travel through the database here (PostgreSQL without Redis)."""
    return not get_settings().REDIS_ALIAS and connection.vendor == "postgresql"


def notification(task_types: Iterable[str]) -> tuple[str, list[str]] | None:
    """The statement that wakes workers for these types through the database (None if they are not woken so).

    Sent inside a transaction, it takes effect when that commits; a caller may run it with its
    own statement (one round trip).
    """
    if not by_database():
        return None
    payload = ",".join(sorted(set(task_types)))
    if len(payload) > PG_PAYLOAD_MAX:
        payload = ""  # too many types for one notice: "look at every type"
    return "SELECT pg_notify(%s, %s)", [PG_WAKEUP, payload]


def notify_now(task_types: Iterable[str]) -> None:
    """Send the database's wake-up notice for these types now, in the current transaction if any (see notification)."""
    _notify(notification(task_types))


def _notify(statement: tuple[str, list[Any]] | None) -> None:
    if statement is None:
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute(*statement)
    except Exception as exc:  # polling covers a missed wake-up; the caller's own error, if any, matters more
        log.warning("wake-up notice not sent: %s", exc)


class _Publisher:
    """Sends wake-ups from a background thread, merging those that pile up meanwhile.

    A producer pays only for its INSERT, not a Redis round trip per enqueue; under load many
    enqueues share one message per burst.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def send(self, task_types: set[str]) -> None:
        with self._lock:
            self._pending |= task_types
            # Started on first use (in a fork child too), and again if it died: a dead publisher
            # must not silence wake-ups for the rest of the process's life.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="taskflow-wakeup-publisher", daemon=True)
                self._thread.start()
        self._ready.set()

    def _run(self) -> None:
        held = _HeldConnection()
        while True:
            self._ready.wait()
            self._ready.clear()
            with self._lock:
                types, self._pending = self._pending, set()
            if not types:
                continue
            try:
                held.command(get_redis(), "PUBLISH", channel(), ",".join(sorted(types)))
            except RedisError as exc:  # polling covers a missed wake-up
                log.warning("wake-up publish failed: %s", exc)
            except Exception:
                log.exception("wake-up publish failed unexpectedly")
            # Under a stream of enqueues, what arrives in the next moment goes out as one message;
            # an isolated enqueue is published at once, so this adds latency only under load.
            time.sleep(MERGE_WINDOW)


def publisher_name() -> str:
    """The Redis client name of this process's wake-up publisher connection."""
    return f"taskflow-wakeups-{os.getpid()}"


class _HeldConnection:
    """One Redis connection kept by a thread that sends one command at a time, skipping the client's per-call work.

    redis-py's `client.publish` takes a connection from the pool and gives it back on every call:
    about 140 µs of CPU, against 50 µs for the command on a held connection, and the publisher sends
    one for every few enqueues under a stream. A held connection that fails (Redis restarted, the
    connection killed while idle) is replaced and the command sent once more on the new one.
    """

    def __init__(self) -> None:
        self._pool: Any = None
        self._connection: Any = None

    def command(self, client: Any, *args: Any) -> Any:
        while True:
            fresh = self._connection is None or client.connection_pool is not self._pool
            try:
                if fresh:  # first use, after a failure, or the deployment's client changed (settings in tests)
                    self.drop()
                    self._pool = client.connection_pool
                    self._connection = self._pool.get_connection()
                    self._name()
                self._connection.send_command(*args)
                return self._connection.read_response()
            except RedisError:
                self.drop()
                if fresh:
                    raise
            except BaseException:
                self.drop()
                raise

    def _name(self) -> None:
        """Name the connection, so CLIENT LIST tells which process's publisher it is (best effort: a proxy may
        refuse CLIENT commands)."""
        from redis.exceptions import ResponseError

        self._connection.send_command("CLIENT", "SETNAME", publisher_name())
        with contextlib.suppress(ResponseError):
            self._connection.read_response()

    def drop(self) -> None:
        connection, pool = self._connection, self._pool
        self._pool = self._connection = None
        if connection is not None:
            with contextlib.suppress(Exception):  # it may be broken already; it is let go either way
                connection.disconnect()
            with contextlib.suppress(Exception):
                pool.release(connection)


_publisher = _Publisher()
# A fork child starts afresh: the parent's lock may have been held by its publisher at the fork.
os.register_at_fork(after_in_child=_publisher._reset)


def stop_channel() -> str:
    """The pub/sub channel that tells workers to stop attempts (an operator terminated their task)."""
    return key("stop")


StopListener = Callable[[dict[int, int]], None]
_local_stop: list[StopListener] = []


def publish_stops(attempts: dict[int, int]) -> None:
    """Tell the workers running these attempts ({task id: lease token}) that they were stopped.

    Best effort, for promptness only: a worker also notices at its next liveness beat, and the
    attempt's writes are refused by its fencing token either way.
    """
    if not attempts:
        return
    for listener in list(_local_stop):
        listener(attempts)
    items = [f"{task_id}:{token}" for task_id, token in attempts.items()]
    client = get_redis()
    if client is not None:
        try:
            client.publish(stop_channel(), ",".join(items))
        except RedisError as exc:
            log.warning("stop notice not published (%s); workers notice at their next beat", exc)
    elif by_database():
        while items:
            part, size = [], 0
            while items and size + len(items[0]) < PG_PAYLOAD_MAX:
                size += len(items[0]) + 1
                part.append(items.pop(0))
            _notify(("SELECT pg_notify(%s, %s)", [PG_STOP, ",".join(part)]))


def add_local_stop_listener(listener: StopListener) -> None:
    _local_stop.append(listener)


def remove_local_stop_listener(listener: StopListener) -> None:
    if listener in _local_stop:
        _local_stop.remove(listener)


def add_local_listener(listener: Listener) -> None:
    _local.append(listener)


def remove_local_listener(listener: Listener) -> None:
    if listener in _local:
        _local.remove(listener)


class RedisListener:
    """Subscribes to the wake-up and stop channels: calls `on_wakeup` with announced types, `on_stop` with attempts.

    `listen` is one subscription; the worker runs it as a supervised loop, which waits out a Redis
    outage and subscribes again.
    """

    def __init__(self, on_wakeup: Listener, stop: threading.Event, on_stop: StopListener | None = None) -> None:
        self.on_wakeup, self.stop, self.on_stop = on_wakeup, stop, on_stop

    def listen(self) -> bool:
        """Listen until `stop` is set (then return False); raises when Redis fails."""
        client = get_redis()
        if client is None:
            return False
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            wakeups, stops = channel(), stop_channel()
            pubsub.subscribe(wakeups, stops)
            # Anything published while we were (re)connecting was missed: look once.
            self.on_wakeup(set())
            while not self.stop.is_set():
                message = pubsub.get_message(timeout=0.5)
                if not message or message.get("type") != "message":
                    continue
                data = _text(message["data"])
                if _text(message["channel"]) == stops:
                    if self.on_stop is not None:
                        self.on_stop(_attempts(data))
                else:
                    self.on_wakeup({t for t in data.split(",") if t})
        finally:
            with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped anyway
                pubsub.close()
        return False


class PostgresListener:
    """LISTENs on the database's wake-up and stop channels, on a connection of its own (see RedisListener)."""

    def __init__(self, on_wakeup: Listener, stop: threading.Event, on_stop: StopListener | None = None) -> None:
        self.on_wakeup, self.stop, self.on_stop = on_wakeup, stop, on_stop

    def listen(self) -> bool:
        """Listen until `stop` is set (then return False); raises OperationalError when the connection fails."""
        import psycopg

        try:
            wrapper = connections[DEFAULT_DB_ALIAS]
            with psycopg.connect(**wrapper.get_connection_params(), autocommit=True) as conn:
                conn.execute(f"LISTEN {PG_WAKEUP}")
                conn.execute(f"LISTEN {PG_STOP}")
                # Anything sent while we were (re)connecting was missed: look once.
                self.on_wakeup(set())
                while not self.stop.is_set():
                    for notice in conn.notifies(timeout=0.5):
                        if notice.channel == PG_STOP:
                            if self.on_stop is not None:
                                self.on_stop(_attempts(notice.payload))
                        else:
                            self.on_wakeup({t for t in notice.payload.split(",") if t})
                        if self.stop.is_set():
                            break
        except psycopg.Error as exc:
            # As Django's own errors, so whoever runs this waits out an outage the usual way.
            raise OperationalError(f"wake-up listener: {exc}") from exc
        return False


LISTEN_FIRST_PAUSE, LISTEN_MAX_PAUSE = 0.5, 10.0
LISTEN_GIVE_UP_AFTER = 5  # unexpected errors in a row (not outages) before the listener counts as broken
LISTENER_THREAD = "taskflow-wakeup"


def start_listener(
    on_wakeup: Listener,
    stop: threading.Event,
    on_stop: StopListener | None = None,
    *,
    on_fatal: Callable[[str], None] | None = None,
) -> threading.Thread | None:
    """Start the thread that receives this deployment's wake-ups and stop notices, if it has any.

    Redis pub/sub when Redis is configured, else LISTEN on PostgreSQL; None elsewhere (polling
    alone). The thread runs until `stop` is set. Like a worker's other loops it never dies
    silently: a Redis or database error is an outage, waited out with a growing pause before it
    connects again (a lost wake-up only waits for the next poll); any other error is logged with
    its traceback, and `on_fatal` is told if one comes LISTEN_GIVE_UP_AFTER times in a row or the
    thread dies of something it cannot catch.
    """
    if get_redis() is not None:
        listener: RedisListener | PostgresListener = RedisListener(on_wakeup, stop, on_stop)
    elif by_database():
        listener = PostgresListener(on_wakeup, stop, on_stop)
    else:
        return None
    thread = threading.Thread(
        target=_listen_until_stopped, args=(listener, stop, on_fatal), name=LISTENER_THREAD, daemon=True
    )
    thread.start()
    return thread


def _listen_until_stopped(
    listener: RedisListener | PostgresListener, stop: threading.Event, on_fatal: Callable[[str], None] | None
) -> None:
    pause, outage, unexpected = LISTEN_FIRST_PAUSE, False, 0
    try:
        while not stop.is_set():
            try:
                listener.listen()
            except (DatabaseError, RedisError) as exc:
                if not outage:  # once per outage, not once per try
                    log.warning("wake-up listener failed (%s); connecting again, workers poll meanwhile", exc)
                outage = True
            except Exception:
                unexpected += 1
                log.exception("%s failed unexpectedly", LISTENER_THREAD)
                if unexpected >= LISTEN_GIVE_UP_AFTER:
                    raise
            else:
                if outage:
                    log.info("wake-up listener connected again")
                pause, outage, unexpected = LISTEN_FIRST_PAUSE, False, 0
            stop.wait(pause)
            pause = min(pause * 2, LISTEN_MAX_PAUSE)
    except BaseException as exc:
        log.critical("%s died", LISTENER_THREAD, exc_info=True)
        if on_fatal is not None:
            on_fatal(f"{LISTENER_THREAD} died: {type(exc).__name__}: {exc}")
    finally:
        for conn in connections.all(initialized_only=True):  # the thread's own, if any was opened
            with contextlib.suppress(Exception):
                conn.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _attempts(data: str) -> dict[int, int]:
    out = {}
    for item in data.split(","):
        task_id, _, token = item.partition(":")
        if task_id.isdigit() and token.isdigit():
            out[int(task_id)] = int(token)
    return out
