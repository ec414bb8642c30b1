"""Time-ordered 64-bit task ids (snowflake layout) that stay unique across tables, hosts and processes.

Layout, most significant first: 41 bits of milliseconds since 2025-01-01, 10 bits of node number,
12 bits of sequence within the millisecond. Ids are minted by the client before the INSERT, so a
bulk insert knows its ids and a row keeps its id when it is moved to a history table.

Uniqueness rests on one rule: a process mints under a node only while it holds that node's lease,
and only in a range of milliseconds no other holder of the node ever used. A lease says how far
its holder may mint (`limit_ms`) and where the previous holder stopped (`floor_ms`); the store of
leases (`nodes.py`, wired in by the app's `ready()`) records the limit before the holder passes
it, so the next holder starts above it even if the clock was stepped back in between. This module
knows nothing of the database, so the Task model can use `next_id` as its default without an
import cycle.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Protocol

EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
NODE_BITS = 10
SEQUENCE_BITS = 12
MAX_NODE = (1 << NODE_BITS) - 1
MAX_SEQUENCE = (1 << SEQUENCE_BITS) - 1
RENEW_RETRY = 5.0  # seconds between attempts to renew a lease that is still valid

logger = logging.getLogger(__name__)


def timestamp_ms(task_id: int) -> int:
    """The Unix time in milliseconds at which an id was minted."""
    return (task_id >> (NODE_BITS + SEQUENCE_BITS)) + EPOCH_MS


def node_of(task_id: int) -> int:
    """The node number an id was minted under."""
    return (task_id >> SEQUENCE_BITS) & MAX_NODE


@dataclass(frozen=True)
class NodeLease:
    """The right to mint under `node` for the milliseconds (floor_ms, limit_ms], Unix time."""

    node: int
    floor_ms: int  # the previous holder minted up to here: mint strictly above it
    limit_ms: int  # recorded in the store: renew before minting past it
    renew_after: float  # time.monotonic(): renew when minting after this
    valid_until: float  # time.monotonic(): past this the store may have given the node away
    token: object = None  # the store's handle (owner string, lock file descriptor)


class NodeSource(Protocol):
    """Where the generator leases its node (see nodes.py)."""

    def acquire(self, from_ms: int) -> NodeLease:
        """Lease a free node, allowed to mint from `from_ms` on."""

    def renew(self, lease: NodeLease, up_to_ms: int) -> NodeLease | None:
        """Extend the lease (time and limit, to at least `up_to_ms`); None when it was lost."""

    def release(self, lease: NodeLease, last_ms: int) -> None:
        """Give the node up, recording that ids under it went up to `last_ms`."""

    def forget(self, lease: NodeLease) -> None:
        """In a forked child: drop the parent's lease without releasing it (the parent still mints)."""


class _NoSource:
    def acquire(self, from_ms: int) -> NodeLease:
        raise RuntimeError("taskflow ids: no node source; is 'taskflow' in INSTALLED_APPS and the app registry ready?")

    def renew(self, lease: NodeLease, up_to_ms: int) -> NodeLease | None:
        return None

    def release(self, lease: NodeLease, last_ms: int) -> None:
        pass

    def forget(self, lease: NodeLease) -> None:
        pass


def _wall_ms() -> int:
    return int(time.time() * 1000)


class IdGenerator:
    """Mints ids for one process; thread-safe, and a forked child leases a node of its own."""

    def __init__(self, node_source: NodeSource | None = None) -> None:
        self.node_source: NodeSource = node_source or _NoSource()
        self._lock = threading.Lock()
        self._last_ms = 0
        self._sequence = 0
        self._lease: NodeLease | None = None
        self._pid = os.getpid()
        self._exit_hook_pid = 0

    @property
    def lease(self) -> NodeLease | None:
        return self._lease

    def next_id(self) -> int:
        return self.next_ids(1)[0]

    def next_ids(self, count: int) -> list[int]:
        if self._pid != os.getpid():  # a fork the at-fork hook did not see (e.g. from C code)
            self._after_fork_in_child()
        with self._lock:
            lease = self._usable_lease()
            out: list[int] = []
            while len(out) < count:
                now = _wall_ms()
                # A clock that steps back must not repeat ids: keep counting in the last millisecond.
                if now > self._last_ms:
                    ms, sequence = now, 0
                elif self._sequence < MAX_SEQUENCE:
                    ms, sequence = self._last_ms, self._sequence + 1
                else:
                    ms, sequence = self._last_ms + 1, 0
                if ms > lease.limit_ms:
                    lease = self._extend(lease, ms)  # may move to another node with a higher floor
                    continue
                self._last_ms, self._sequence = ms, sequence
                out.append(((ms - EPOCH_MS) << (NODE_BITS + SEQUENCE_BITS)) | (lease.node << SEQUENCE_BITS) | sequence)
            return out

    def release(self) -> None:
        """Give this process's node back (at exit); the next id leases one again."""
        # A daemon thread stuck in a renewal must not hang the interpreter's exit: the lease
        # then simply runs out.
        if not self._lock.acquire(timeout=5):
            return
        try:
            lease, self._lease = self._lease, None
            if lease is None or self._pid != os.getpid():
                return
            try:
                self.node_source.release(lease, max(self._last_ms, lease.floor_ms))
            except Exception:  # at exit the database may be gone; the lease then runs out by itself
                logger.debug("could not release id node %s", lease.node, exc_info=True)
        finally:
            self._lock.release()

    def _usable_lease(self) -> NodeLease:
        lease = self._lease
        if lease is None:
            return self._take_new()
        now = time.monotonic()
        if now < lease.renew_after:
            return lease
        try:
            renewed = self.node_source.renew(lease, _wall_ms())
        except Exception:
            if now >= lease.valid_until:
                raise  # the store may have handed the node to someone else: mint nothing under it
            logger.warning("could not renew id node %s; retrying shortly", lease.node, exc_info=True)
            # Still ours for a while: keep minting, and do not pay a failing round trip per id.
            self._lease = replace(lease, renew_after=min(now + RENEW_RETRY, lease.valid_until))
            return self._lease
        return self._adopt(lease, renewed)

    def _extend(self, lease: NodeLease, up_to_ms: int) -> NodeLease:
        return self._adopt(lease, self.node_source.renew(lease, up_to_ms))

    def _adopt(self, lease: NodeLease, renewed: NodeLease | None) -> NodeLease:
        if renewed is not None:
            self._lease = renewed
            return renewed
        logger.warning("id node %s was lost; leasing another", lease.node)
        self._lease = None
        return self._take_new()

    def _take_new(self) -> NodeLease:
        lease = self.node_source.acquire(max(_wall_ms(), self._last_ms))
        if lease.floor_ms >= self._last_ms:
            # Start above every id the node's previous holder minted.
            self._last_ms, self._sequence = lease.floor_ms, MAX_SEQUENCE
        self._lease = lease
        if self._exit_hook_pid != self._pid:
            # Registered here, not at import: multiprocessing clears atexit in its forked children.
            atexit.register(self.release)
            self._exit_hook_pid = self._pid
        return lease

    def _after_fork_in_child(self) -> None:
        # The parent keeps minting under its node; the child must lease its own and must not
        # release the parent's. The lock may have been held by a thread that does not exist here.
        self._lock = threading.Lock()
        self._pid = os.getpid()
        lease, self._lease = self._lease, None
        if lease is not None:
            self.node_source.forget(lease)


_generator = IdGenerator()
next_ids = _generator.next_ids
if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=lambda: _generator._after_fork_in_child())


def use_node_source(source: NodeSource) -> None:
    """Set where this process's generator leases its node (called once, by the app's ready())."""
    _generator.node_source = source


def next_id() -> int:
    """A new task id; a module-level function so migrations can reference it as Task.id's default."""
    return _generator.next_id()


def current_lease() -> NodeLease | None:
    """The node lease this process mints under, if any (for operators and tests)."""
    return _generator.lease


def release_node() -> None:
    """Give this process's node back now (it is also given back at exit)."""
    _generator.release()
