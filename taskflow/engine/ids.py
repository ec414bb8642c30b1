"""Time-ordered 64-bit task ids (snowflake layout) that stay unique across tables and hosts.

Layout, most significant first: 41 bits of milliseconds since 2025-01-01, 10 bits of node number,
12 bits of sequence within the millisecond. Ids are minted by the client before the INSERT, so a
bulk insert knows its ids and a row keeps its id when it is moved to a history table.

The node number comes from a lease (`nodes.py`), wired in by the app's `ready()`: this module
knows nothing of the database, so the Task model can use `next_id` as its default without an
import cycle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
NODE_BITS = 10
SEQUENCE_BITS = 12
MAX_NODE = (1 << NODE_BITS) - 1
MAX_SEQUENCE = (1 << SEQUENCE_BITS) - 1

# Returns this process's node number and how long (time.monotonic() deadline) it may mint under it.
NodeSource = Callable[[], tuple[int, float]]


def timestamp_ms(task_id: int) -> int:
    """The Unix time in milliseconds at which an id was minted."""
    return (task_id >> (NODE_BITS + SEQUENCE_BITS)) + EPOCH_MS


def _no_source() -> tuple[int, float]:
    raise RuntimeError("taskflow ids: no node source; is 'taskflow' in INSTALLED_APPS and the app registry ready?")


class IdGenerator:
    """Mints ids for one process; thread-safe."""

    def __init__(self, node_source: NodeSource = _no_source) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._sequence = 0
        self._node: int | None = None
        self._node_until = 0.0
        self.node_source = node_source

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
        if self._node is None or time.monotonic() > self._node_until:
            self._node, self._node_until = self.node_source()
        return self._node


_generator = IdGenerator()
next_ids = _generator.next_ids


def use_node_source(source: NodeSource) -> None:
    """Set where this process's generator gets its node number (called once, by the app's ready())."""
    _generator.node_source = source


def next_id() -> int:
    """A new task id; a module-level function so migrations can reference it as Task.id's default."""
    return _generator.next_id()
