"""Leader election for taskwatch: one named lease with an owner token and a TTL, renewed while alive.

Any number of taskwatch processes may run; the one holding the lease acts, the others keep trying
and one of them takes over within one TTL after the leader dies. The leader acts only while its
lease is certainly still its own: a failed renewal, or a renewal older than most of the TTL (a
stalled process), stops it before another process can have taken over.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time

from django.db import DatabaseError, connection

from ..conf import get_settings
from ..engine import locks

log = logging.getLogger("taskflow.watch")

LEADER_LOCK = "taskwatch"
# Of the TTL, the part during which a renewal is trusted: the rest absorbs the delay between our
# clock reading and the lease's own expiry, and clock drift between hosts with the database lock.
_TRUSTED_FRACTION = 0.8


def new_owner_id() -> str:
    """A lease owner token that also tells an operator which process holds it."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Leadership:
    """This process's claim on the leader lease; `active` is true only while acting is safe."""

    def __init__(self, name: str = LEADER_LOCK, *, ttl: float | None = None, owner: str | None = None) -> None:
        self.name = name
        self.ttl = get_settings().LEADER_TTL if ttl is None else ttl
        if self.ttl <= 0:
            raise ValueError("the leader TTL must be positive")
        self.owner = owner or new_owner_id()
        self._leading = False
        self._trusted_until = 0.0

    @property
    def leading(self) -> bool:
        """Whether the last attempt to take or renew the lease succeeded."""
        return self._leading

    @property
    def active(self) -> bool:
        """Whether this process may act now: it leads and its last renewal is recent enough."""
        return self._leading and time.monotonic() < self._trusted_until

    def renew(self) -> bool:
        """Take the lease, or extend it if ours; returns whether this process leads afterwards."""
        # Read the clock before asking: the lease runs at least TTL from any moment after this.
        asked_at = time.monotonic()
        try:
            held = locks.acquire(self.name, self.owner, self.ttl)
        except Exception as exc:  # Redis or the database unreachable: not knowing means not leading
            log.warning("leader lease %s could not be renewed (%s)", self.name, exc)
            if isinstance(exc, DatabaseError):
                connection.close()
            held = False
        self._trusted_until = asked_at + self.ttl * _TRUSTED_FRACTION if held else 0.0
        if held and not self._leading:
            log.info("%s is now the leader (lease %s, ttl %.1fs)", self.owner, self.name, self.ttl)
        elif self._leading and not held:
            log.warning("%s lost the leader lease %s: stopping all duties", self.owner, self.name)
        self._leading = held
        return held

    def resign(self) -> None:
        """Give the lease up (if still ours) so another process can take over at once."""
        was_leading, self._leading, self._trusted_until = self._leading, False, 0.0
        if not was_leading:
            return
        try:
            locks.release(self.name, self.owner)
            log.info("%s resigned the leader lease %s", self.owner, self.name)
        except Exception as exc:  # it expires by itself within one TTL
            log.warning("could not release the leader lease %s (%s)", self.name, exc)

    def holder(self) -> str | None:
        """The owner currently holding the lease, if any."""
        return locks.holder(self.name)
