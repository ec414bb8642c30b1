"""Node numbers for the id generator: each live process holds one, so no two mint the same id.

Leased through `locks` (a Redis key or a database row with a TTL), or, on SQLite without Redis,
held as an OS file lock beside the database for the process's life.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import time
from pathlib import Path
from tempfile import gettempdir

from django.db import connection

from ..conf import get_settings
from . import locks
from .ids import MAX_NODE

NODE_LEASE_TTL = 24 * 3600.0


class NodeLeases:
    """The node source wired into `ids` by the app: leases a node and says how long it may be used."""

    def __init__(self) -> None:
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{random.getrandbits(32):08x}"
        self._node_file: int | None = None

    def __call__(self) -> tuple[int, float]:
        fixed = get_settings().NODE_ID
        if fixed is not None:
            return fixed & MAX_NODE, float("inf")
        if connection.vendor == "sqlite" and get_settings().REDIS_ALIAS is None:
            name = str(connection.settings_dict["NAME"])
            home = Path(name).resolve().parent if not name.startswith(("file:", ":memory:")) else Path(gettempdir())
            return self._lock_node_file(home / "id-nodes"), float("inf")
        # Move to a fresh node well before the lease runs out, so no id is ever minted
        # under a node number another process may have leased since.
        until = time.monotonic() + NODE_LEASE_TTL / 2
        for _ in range(64):
            node = random.randint(0, MAX_NODE)
            if locks.acquire(f"id-node:{node}", self._owner, NODE_LEASE_TTL):
                return node, until
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
            return node
        raise RuntimeError("taskflow: no free id-generator node number (over 1024 live processes?)")
