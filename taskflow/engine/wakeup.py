"""Waking workers when work arrives: Redis pub/sub when configured, in-process listeners always.

Wake-ups are a latency optimisation only; workers also poll, so a lost message delays a task by
at most one poll interval and never loses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from django.db import transaction

from .redis import RedisError, get_redis, key

log = logging.getLogger("taskflow.wakeup")
MERGE_WINDOW = 0.002  # seconds
Listener = Callable[[set[str]], None]
_local: list[Listener] = []


def channel() -> str:
    """The pub/sub channel of this deployment's wake-ups (named when used: see redis.namespace)."""
    return key("wakeup")


def notify_on_commit(task_types: Iterable[str]) -> None:
    """Wake workers for these types once the surrounding transaction commits (now, if none)."""
    types = set(task_types)
    if types:
        transaction.on_commit(lambda: publish(types))


def publish(task_types: set[str]) -> None:
    for listener in list(_local):
        listener(task_types)
    if get_redis() is not None:
        _publisher.send(task_types)


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
        while True:
            self._ready.wait()
            self._ready.clear()
            with self._lock:
                types, self._pending = self._pending, set()
            if not types:
                continue
            try:
                get_redis().publish(channel(), ",".join(sorted(types)))
            except RedisError as exc:  # polling covers a missed wake-up
                log.warning("wake-up publish failed: %s", exc)
            except Exception:
                log.exception("wake-up publish failed unexpectedly")
            # Under a stream of enqueues, what arrives in the next moment goes out as one message;
            # an isolated enqueue is published at once, so this adds latency only under load.
            time.sleep(MERGE_WINDOW)


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
    client = get_redis()
    if client is not None:
        try:
            client.publish(stop_channel(), ",".join(f"{task_id}:{token}" for task_id, token in attempts.items()))
        except RedisError as exc:
            log.warning("stop notice not published (%s); workers notice at their next beat", exc)


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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _attempts(data: str) -> dict[int, int]:
    out = {}
    for item in data.split(","):
        task_id, _, token = item.partition(":")
        if task_id.isdigit() and token.isdigit():
            out[int(task_id)] = int(token)
    return out
