"""How far a running attempt got: what a handler reports with `ctx.progress(done, total, message)`.

A report is checked here (`progress_of`), held by the attempt's `ProgressThrottle` and written at
most once every WRITE_INTERVAL seconds with a heartbeat (its one guarded UPDATE: see
attempts.heartbeat), so a loop reporting a million times writes a few rows. The worker writes the
last value left over when the handler returns (`TaskContext.flush_progress`), before its report.

The task's `progress` column holds the attempt's fencing token with the value (`stored`). A claim
increments the token, so a new attempt shows no progress until it reports its own (`shown`),
without the claim writing anything more. No Django import: the remote worker uses this module.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..exceptions import InvalidTask

MAX_MESSAGE = 200  # characters
MAX_NUMBER = 2**53  # the largest integer every JSON reader (a browser's too) holds exactly
WRITE_INTERVAL = 1.0  # seconds between two writes of one attempt's progress


@dataclass(frozen=True)
class Progress:
    done: float
    total: float
    message: str = ""

    def stored(self, lease_token: int, at: datetime) -> dict[str, Any]:
        """The task's `progress` column: this value, the attempt's token, and when it was reported."""
        return {
            "done": self.done,
            "total": self.total,
            "message": self.message,
            "lease": lease_token,
            "at": at.isoformat(),
        }

    def as_json(self) -> dict[str, Any]:
        """As the remote API carries it."""
        return {"done": self.done, "total": self.total, "message": self.message}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTask(f"progress {name} must be a number; got {value!r:.50}")
    if not 0 <= value <= MAX_NUMBER:  # NaN compares false too
        raise InvalidTask(f"progress {name} must be a number from 0 to {MAX_NUMBER}; got {value!r:.50}")
    return value


def progress_of(done: Any, total: Any, message: Any = "") -> Progress:
    """A valid progress report; InvalidTask says what is wrong (numbers >= 0, done <= total, a short message)."""
    done, total = _number("done", done), _number("total", total)
    if done > total:
        raise InvalidTask(f"progress done must not exceed total; got done={done!r} > total={total!r}")
    if not isinstance(message, str):
        raise InvalidTask(f"progress message must be a string; got {type(message).__name__}")
    if len(message) > MAX_MESSAGE:
        raise InvalidTask(f"progress message must be at most {MAX_MESSAGE} characters; got {len(message)}")
    return Progress(done, total, message)


def shown(stored: Any, lease_token: int) -> dict[str, Any] | None:
    """The progress of the task's current (or last) attempt, or None: a value stored by an earlier attempt is not.

    {"done", "total", "message", "percent" (0-100, None when total is 0), "at" (ISO 8601)}.
    """
    if not isinstance(stored, dict) or stored.get("lease") != lease_token:
        return None
    done, total = stored.get("done"), stored.get("total")
    if not isinstance(done, (int, float)) or not isinstance(total, (int, float)):
        return None
    percent = round(min(100.0, 100.0 * done / total), 1) if total > 0 else None
    message = stored.get("message") or ""
    return {"done": done, "total": total, "message": message, "percent": percent, "at": stored.get("at")}


_PLAIN_NUMBERS = (int, float)


class ProgressThrottle:
    """One attempt's latest progress, and whether it is due to be written (at most once per interval).

    `offer` is the hot path (a handler may call it in its innermost loop): a plain check, a clock
    read and a tuple; a Progress is built only for a write.
    """

    def __init__(self, interval: float = WRITE_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self._pending: tuple[Any, Any, Any] | None = None
        self._written_at = -math.inf

    @property
    def pending(self) -> Progress | None:
        return None if self._pending is None else Progress(*self._pending)

    def offer(self, done: Any, total: Any, message: Any = "") -> Progress | None:
        """Keep this progress as the latest (InvalidTask if malformed); returns it if a write is due now."""
        if not (
            type(done) in _PLAIN_NUMBERS
            and type(total) in _PLAIN_NUMBERS
            and type(message) is str
            and 0 <= done <= total <= MAX_NUMBER
            and len(message) <= MAX_MESSAGE
        ):
            done, total, message = dataclasses.astuple(progress_of(done, total, message))  # raises, or a subclass
        now = self.clock()
        if now - self._written_at < self.interval:
            self._pending = (done, total, message)
            return None
        self._pending, self._written_at = None, now
        return Progress(done, total, message)

    def take(self) -> Progress | None:
        """The latest progress not yet written, if any, now counted as written (it rides on the next write)."""
        pending, self._pending = self.pending, None
        if pending is not None:
            self._written_at = self.clock()
        return pending
