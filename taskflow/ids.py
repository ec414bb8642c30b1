"""Time-ordered 64-bit task ids (snowflake layout) that stay unique across tables and hosts.

Layout, most significant first: 41 bits of milliseconds since 2025-01-01, 10 bits of node number,
12 bits of sequence within the millisecond. Ids are minted by the client before the INSERT, so a
bulk insert knows its ids and a row keeps its id when it is moved to a history table.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import threading
import time
from pathlib import Path
from tempfile import gettempdir

from django.db import connection

from . import locks
from .conf import get_settings

EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
NODE_BITS = 10
SEQUENCE_BITS = 12
MAX_NODE = (1 << NODE_BITS) - 1
MAX_SEQUENCE = (1 << SEQUENCE_BITS) - 1
NODE_LEASE_TTL = 24 * 3600.0


def timestamp_ms(task_id: int) -> int:
    """The Unix time in milliseconds at which an id was minted."""
    return (task_id >> (NODE_BITS + SEQUENCE_BITS)) + EPOCH_MS


class IdGenerator:
    """Mints ids for one process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._sequence = 0
        self._node: int | None = None
        self._node_until = 0.0
        self._node_file: int | None = None
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{random.getrandbits(32):08x}"

    def next_id(self) -> int:
        return self.next_ids(1)[0]

    def next_ids(self, count: int) -> list[int]:
        with self._lock:
            node = self._current_node()
            out = []
            for _ in range(count):
                now = int(time.time() * 1000)
                # A clock that steps back must not repeat ids: keep counting in the last millisecond.
                if now <= self._last_ms:
                    self._sequence += 1
                    if self._sequence > MAX_SEQUENCE:
                        self._last_ms += 1
                        self._sequence = 0
                else:
                    self._last_ms, self._sequence = now, 0
                out.append(((self._last_ms - EPOCH_MS) << 22) | (node << SEQUENCE_BITS) | self._sequence)
            return out

    def _current_node(self) -> int:
        fixed = get_settings().NODE_ID
        if fixed is not None:
            return fixed & MAX_NODE
        if self._node is None or time.monotonic() > self._node_until:
            # Move to a fresh node well before the lease runs out, so no id is ever minted
            # under a node number another process may have leased since.
            self._node_until = time.monotonic() + NODE_LEASE_TTL / 2
            self._node = self._lease_node()
        return self._node

    def _lease_node(self) -> int:
        if connection.vendor == "sqlite" and get_settings().REDIS_ALIAS is None:
            name = str(connection.settings_dict["NAME"])
            home = Path(name).resolve().parent if not name.startswith(("file:", ":memory:")) else Path(gettempdir())
            return self._lock_node_file(home / "id-nodes")
        for _ in range(64):
            node = random.randint(0, MAX_NODE)
            if locks.acquire(f"id-node:{node}", self._owner, NODE_LEASE_TTL):
                return node
        raise RuntimeError("taskflow: no free id-generator node number (over 1024 live processes?)")

    def _lock_node_file(self, folder: Path) -> int:
        """Hold an OS lock on one of 1024 files beside the SQLite database for this process's life.

        SQLite is single-host, and a database lease would wait on the caller's own write lock
        (SQLite serialises writers), so the node is leased from the file system instead; the
        kernel frees the lock when the process dies, however it dies.
        """
        folder.mkdir(parents=True, exist_ok=True)
        start = os.getpid() & MAX_NODE
        for offset in range(MAX_NODE + 1):
            node = (start + offset) & MAX_NODE
            fd = os.open(folder / f"{node}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._node_file = fd  # kept open: closing it would release the lock
            self._node_until = float("inf")
            return node
        raise RuntimeError("taskflow: no free id-generator node number (over 1024 live processes?)")


_generator = IdGenerator()
next_ids = _generator.next_ids


def next_id() -> int:
    """A new task id; a module-level function so migrations can reference it as Task.id's default."""
    return _generator.next_id()
