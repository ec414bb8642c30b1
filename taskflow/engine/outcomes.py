"""How an attempt ended: the `Outcome` and the `Report` a worker sends of it.

Free of Django, so the remote worker (no settings, no database) builds the same reports as the
local one; the engine writes them (`finishing.finish_attempts`), the HTTP channel sends them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..exceptions import NextStage


class Outcome(enum.StrEnum):
    SUCCESS = "success"
    ERROR = "error"  # retried by the policy while attempts remain
    FAIL = "fail"  # permanent: no more attempts
    SNOOZE = "snooze"  # run later, the attempt not counted
    NEXT_STAGE = "next_stage"
    RESCUED = "rescued"  # taken away by taskwatch (dead worker or deadline): a failed attempt
    HANDBACK = "handback"  # claimed but never started: back to pending as it was
    TERMINATED = "terminated"  # stopped by an operator while running: the task ends stopped
    LOST = "lost"  # the attempt was taken away while running: nothing to write


class StopRequest:
    """Whether an attempt was told to stop (an operator, a rescue, shutdown): set once, read by its handler.

    Only `set` and `is_set` are ever called, nobody waits on it, so it is a plain flag (a write
    or read of one attribute is atomic), not a threading.Event: an Event's lock and condition cost
    more than the rest of an attempt's object, built for every task claimed, held or reported.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


@dataclass(eq=False)  # compared by identity: two reports are never "the same"
class Report:
    """The end of one attempt, as the worker saw it (`task`: the attempt, a ClaimedTask or a remote one)."""

    task: Any
    outcome: Outcome
    result: Any = None
    error: str = ""
    detail: str = ""  # traceback, kept in status_msg (and the end of it in the schedule log)
    exception: str = ""  # the class path of what ended the attempt, if it failed ("builtins.ValueError")
    delay: float = 0.0
    next_stage: NextStage | None = None
    cost_ms: int = 0
    result_size: int | None = None  # bytes of the result as JSON, if already measured (the worker does)
    written: dict[str, Any] | None = None  # the columns finish_attempts wrote, once accepted
    # Whether other tasks may wait for this one (its write did not rule it out): its end releases them.
    waited_for: bool = True
