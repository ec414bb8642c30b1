"""Node numbers for the id generator: each live process leases its own, so no two mint the same id.

On PostgreSQL and MySQL a node is a row of `IdNode`, taken by a guarded UPDATE and judged by the
database's clock, so neither a Redis that loses its keys nor a host whose clock is wrong can hand
a node to two processes. On SQLite (one host, one writer: a row lease would wait on the caller's own
write lock) a node is an OS file lock in a folder beside the database file (`id-nodes/<its file name>`:
one per database, so two databases side by side never share nodes), which the kernel frees when its
process dies. Either store records how far its holder may mint (`mint_limit`, Unix ms) before the
holder passes it, and the next holder of the node mints only above it (see ids.py).
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import socket
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from tempfile import gettempdir

from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now

from ..models import IdNode
from .ids import MAX_NODE, NodeLease, NodeSource
from .locks import _outside_caller_transaction

# A crashed process's node is free again this long after its last renewal. Short, so crashes and
# processes that never reach their exit hooks cannot use up the 1,024 nodes; a holder renews at
# half of it (at its next mint) and stops trusting its lease at 90 % of it.
NODE_LEASE_TTL = 600.0
# On SQLite a dead process's lock is freed at once, so its limit runs only a little ahead of the
# clock: a crash then pushes the next holder's ids at most this far into the future.
FILE_LIMIT_AHEAD_MS = 10_000


def node_source() -> NodeSource:
    """The node store for this project's database (wired into the id generator by the app)."""
    return FileNodes() if connection.vendor == "sqlite" else DatabaseNodes()


class DatabaseNow(Now):
    """The database server's clock in UTC (MySQL's CURRENT_TIMESTAMP follows the session's time zone)."""

    def as_mysql(self, compiler, connection, **extra_context):  # noqa: ANN001, ANN003, ANN201
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra_context)


def _no_free_node() -> RuntimeError:
    return RuntimeError(
        "taskflow: all 1024 id nodes are leased (over 1024 processes minting ids at once, or crashed "
        f"ones whose leases run out {NODE_LEASE_TTL:.0f} s after they stopped)"
    )


class DatabaseNodes:
    """Node leases as `IdNode` rows; every statement runs outside the caller's transaction."""

    def acquire(self, from_ms: int) -> NodeLease:
        return _outside_caller_transaction(self._acquire, from_ms)

    def renew(self, lease: NodeLease, up_to_ms: int) -> NodeLease | None:
        return _outside_caller_transaction(self._renew, lease, up_to_ms)

    def release(self, lease: NodeLease, last_ms: int) -> None:
        # The limit comes down to what was really minted, so the next holder's ids start now,
        # not a lease length in the future.
        _outside_caller_transaction(
            lambda: IdNode.objects.filter(node=lease.node, owner=lease.token).update(
                owner="", expires_at=DatabaseNow(), mint_limit=last_ms
            )
        )

    def forget(self, lease: NodeLease) -> None:
        pass  # the row stays the parent's; the child's next id leases another with an owner of its own

    def _acquire(self, from_ms: int) -> NodeLease:
        owner = f"{socket.gethostname()[:100]}:{os.getpid()}:{random.getrandbits(32):08x}"
        held = set(IdNode.objects.filter(expires_at__gt=DatabaseNow()).values_list("node", flat=True))
        start = random.randint(0, MAX_NODE)
        for offset in range(MAX_NODE + 1):
            node = (start + offset) & MAX_NODE
            if node in held:
                continue
            started = time.monotonic()
            taken = _take_row(node, owner, from_ms)
            if taken is not None:
                floor, limit = taken
                return _timed_lease(NodeLease(node, floor, limit, 0.0, 0.0, owner), started)
        raise _no_free_node()

    def _renew(self, lease: NodeLease, up_to_ms: int) -> NodeLease | None:
        limit = max(lease.limit_ms, up_to_ms + int(NODE_LEASE_TTL * 1000))
        started = time.monotonic()
        # Only the owner can extend its lease: once another process took the node, this matches nothing.
        extended = IdNode.objects.filter(node=lease.node, owner=lease.token).update(
            expires_at=DatabaseNow() + timedelta(seconds=NODE_LEASE_TTL), mint_limit=limit
        )
        return _timed_lease(replace(lease, limit_ms=limit), started) if extended else None


def _take_row(node: int, owner: str, from_ms: int) -> tuple[int, int] | None:
    """Lease one node if it is free by the database's clock: (floor, limit), or None when it is not."""
    ahead = int(NODE_LEASE_TTL * 1000)
    expires_at = DatabaseNow() + timedelta(seconds=NODE_LEASE_TTL)
    with transaction.atomic():
        # One guarded UPDATE: of two contenders for a free node, exactly one matches it.
        if IdNode.objects.filter(node=node, expires_at__lte=DatabaseNow()).update(owner=owner, expires_at=expires_at):
            floor = IdNode.objects.values_list("mint_limit", flat=True).get(node=node)
            limit = max(floor, from_ms) + ahead
            IdNode.objects.filter(node=node).update(mint_limit=limit)
            return floor, limit
    try:
        with transaction.atomic():
            IdNode.objects.create(node=node, owner=owner, expires_at=expires_at, mint_limit=from_ms + ahead)
        return 0, from_ms + ahead
    except IntegrityError:  # another process created it first
        return None


def _timed_lease(lease: NodeLease, started: float) -> NodeLease:
    # Timed from before the statement, so the holder's deadline falls before the database's.
    return replace(lease, renew_after=started + NODE_LEASE_TTL / 2, valid_until=started + NODE_LEASE_TTL * 0.9)


class FileNodes:
    """Node leases as OS file locks beside the SQLite database, one file per node holding its limit."""

    def acquire(self, from_ms: int) -> NodeLease:
        folder = _node_folder()
        folder.mkdir(parents=True, exist_ok=True)
        start = random.randint(0, MAX_NODE)
        for offset in range(MAX_NODE + 1):
            node = (start + offset) & MAX_NODE
            fd = os.open(folder / f"{node}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            floor = _read_limit(fd)
            limit = max(floor, from_ms) + FILE_LIMIT_AHEAD_MS
            _write_limit(fd, limit)
            # Kept open for as long as the node is ours: the kernel frees the lock when it closes,
            # including when the process dies, however it dies.
            return NodeLease(node, floor, limit, float("inf"), float("inf"), fd)
        raise _no_free_node()

    def renew(self, lease: NodeLease, up_to_ms: int) -> NodeLease | None:
        limit = max(lease.limit_ms, up_to_ms + FILE_LIMIT_AHEAD_MS)
        _write_limit(lease.token, limit)
        return replace(lease, limit_ms=limit)

    def release(self, lease: NodeLease, last_ms: int) -> None:
        try:
            _write_limit(lease.token, last_ms)
        finally:
            os.close(lease.token)  # type: ignore[arg-type]

    def forget(self, lease: NodeLease) -> None:
        # The descriptor shares its lock with the parent's: closing this copy keeps the parent's
        # lock (flock(LOCK_UN) here would drop it from under the parent).
        os.close(lease.token)  # type: ignore[arg-type]


def _node_folder(database: str | None = None) -> Path:
    """Where the node locks of a SQLite database live (`database`: its NAME; default: this connection's).

    One folder per database file: ids only need to be unique within a database, and two databases
    side by side (the example project's and the test suite's, both under var/) must not take
    each other's nodes.
    """
    name = str(connection.settings_dict["NAME"] if database is None else database)
    if name.startswith(("file:", ":memory:")):
        # In-memory databases live and die with their process: one folder per name is enough.
        return Path(gettempdir()) / "id-nodes" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100]
    path = Path(name).resolve()
    return path.parent / "id-nodes" / path.name


def _read_limit(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).strip() or 0)
    except ValueError:
        return 0


def _write_limit(fd: object, ms: int) -> None:
    # Fixed width, so a shorter number never leaves digits of a longer one behind.
    os.pwrite(fd, f"{ms:020d}\n".encode(), 0)  # type: ignore[arg-type]
