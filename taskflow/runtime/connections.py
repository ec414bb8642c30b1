"""Database connections of long-running threads: one that can no longer serve is dropped before use.

Django drops broken connections around each web request; a worker's threads have no requests, so
they call `drop_unusable()` before each use instead (each claim round, flush, beat, watch pass, and
before every task a handler thread runs). Without it, a connection the server closed (a restart,
a fail-over, MySQL's wait_timeout) fails every later task on its thread.

A health check is a round trip, too dear before every task, so a connection is checked only when
there is a reason to doubt it: an error happened on it, another thread of this process met a
database error since this thread last looked (the server probably went away for everyone), or it
sat unused for IDLE_CHECK seconds (idle connections are what servers and proxies time out). A
connection in use all the time costs a few attribute reads per task; an idle one, one ping per
IDLE_CHECK at most.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from django.db import DatabaseError, connections

from ..engine.redis import RedisError
from .supervision import Loop, Step

IDLE_CHECK = 1.0  # seconds a thread's connections may sit unused before they are pinged

OUTAGES = (DatabaseError, RedisError)  # waited out by a thread's loop, however long they last

_epoch = 0  # bumped whenever some thread meets a database error: every thread then checks
_seen = threading.local()


def suspect_all() -> None:
    """Make every thread of this process check its connections before it uses them next."""
    global _epoch
    _epoch += 1  # a lost increment under a race only means one thread checks a little later


def drop_unusable() -> None:
    """Close this thread's database connections that cannot serve any more (the next query reconnects)."""
    now = time.monotonic()
    idle = now - getattr(_seen, "at", now) > IDLE_CHECK
    doubt = idle or getattr(_seen, "epoch", _epoch) != _epoch
    _seen.at, _seen.epoch = now, _epoch
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        if conn.autocommit != conn.settings_dict["AUTOCOMMIT"]:
            _close(conn)  # left mid-transaction by its last user: do not take chances
        elif doubt or conn.errors_occurred:
            if conn.is_usable():
                conn.errors_occurred = False
            else:
                _close(conn)
                suspect_all()
        elif _obsolete(conn, now):
            _close(conn)


def close_own() -> None:
    """Close this thread's database connections (a thread that ends would leave them open)."""
    for conn in connections.all(initialized_only=True):
        _close(conn)


def _obsolete(conn, now: float) -> bool:  # noqa: ANN001
    # A positive CONN_MAX_AGE retires connections (e.g. to follow a fail-over's DNS). Django's
    # default of 0 means "one per request", which for a worker would be one per query: ignored.
    max_age = conn.settings_dict.get("CONN_MAX_AGE")
    return bool(max_age) and conn.close_at is not None and now >= conn.close_at


def _close(conn) -> None:  # noqa: ANN001
    with contextlib.suppress(DatabaseError):  # closing a broken connection may complain; it is gone anyway
        conn.close()


def supervised(
    name: str, step: Step, *, on_fatal: Callable[[str], None], stop: threading.Event | None = None
) -> Loop:
    """A Loop for a thread that uses the database: outages waited out, its connections closed as it ends."""
    # After an outage the other threads' connections are probably gone too: suspect_all.
    return Loop(name, step, on_fatal=on_fatal, stop=stop, outages=OUTAGES, on_outage=suspect_all, on_exit=close_own)
