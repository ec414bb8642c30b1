"""How a worker reaches the tasks it runs: the one interface the worker runtime is written against.

The runtime (`runner.Runner`) claims, runs, reports, writes off and hands back attempts the same
way whatever holds the tasks; a `Connector` is the thin part that differs: the local worker's
reaches the database through the engine (`worker.DatabaseConnector`), the remote worker's the HTTP
API (`remote.HttpConnector`). As with Procrastinate's connectors and River's drivers, adding a way
to reach the store means writing one of these, not another worker.

This module and the runtime import nothing of Django: the remote worker runs without settings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..engine.outcomes import Report
from .context import AttemptChannel
from .supervision import Loop, Step

if TYPE_CHECKING:
    from .runner import Runner


class ChannelFailed(Exception):
    """The connector cannot go on (a token the server refuses, say): the worker stops and `run` raises `error`."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Claim:
    """What one claim round got: attempts in claim order, and when (time.monotonic()) to claim again at the latest.

    `reserved`: those of them claimed ahead and not started (Connector.start starts them).
    """

    attempts: list[Any] = field(default_factory=list)
    next_look: float = 0.0
    reserved: list[Any] = field(default_factory=list)


# Called by `Connector.report` as reports are settled: (the settled reports, those of them applied).
Settle = Callable[[Sequence[Report], Sequence[Report]], None]


class Connector(Protocol):
    """The store as a worker sees it. Attempts are the connector's own objects; the runtime reads of them
    only what a TaskContext shows (`context.AttemptData`) and their `stop_requested` flag (outcomes.StopRequest)."""

    def bind(self, worker: Runner) -> None:
        """Serve this worker (called once, as it is made)."""

    def open(self) -> None:
        """Start what runs beside the claim loop (liveness beat, wake-up and stop listeners)."""

    def stopping(self) -> None:
        """The worker stops claiming: stop listening for wake-ups."""

    def close(self, *, failed: bool) -> None:
        """After the last report: stop beating (a worker that `failed` keeps looking alive no longer)."""

    def halt(self) -> None:
        """Stop beating at once (any thread): the worker is failing, its attempts will be rescued."""

    def claim(
        self,
        room: int,
        ahead: int,
        capacity: int,
        busy: bool,
        task_types: list[str] | None = None,
        start_ahead: int = 0,
    ) -> Claim:
        """Claim up to `room` due attempts for free threads and `ahead` more to run after them.

        `capacity`: the most the worker runs at once; `busy`: some run now. Attempts claimed ahead
        may be reserved (not started: a worker that dies hands them back uncounted). `task_types`:
        those of the worker's types to claim for (None: all; async handlers' types have a capacity
        of their own, so the runtime claims for them apart). `start_ahead`: how many of `ahead` the
        worker would start right after the claim; the claim may start those instead of reserving them.
        """

    def start(self, reserved: list[Any]) -> list[Any]:
        """Start these reserved attempts as they go to threads; returns those still held (now started)."""

    def between_claims(self, held: list[Any]) -> None:
        """Called on the claim loop between claims and while stopping, with every attempt held and unsettled."""

    def report(self, reports: list[Report], settle: Settle) -> None:
        """Write these ends of attempts (hand-backs too), calling `settle` as they are applied or refused.

        Raises one of `outages` while the store cannot be reached (unsettled reports are kept and sent
        again later), ChannelFailed when it never will be.
        """

    def channel(self, attempt: Any) -> AttemptChannel:
        """What the attempt's TaskContext uses to heartbeat, checkpoint and hear a stop."""

    def prepare(self) -> None:
        """Before a thread uses the store (a claim round, a flush, a handler): e.g. drop dead connections."""

    def check_json(self, name: str, value: Any) -> int:
        """The size of `value` as stored JSON; InvalidTask if it cannot be stored."""

    def after_error(self, exc: BaseException) -> None:
        """A handler raised `exc` (a database error may mean every thread's connection is gone)."""

    def past_deadline(self, attempt: Any) -> bool:
        """Whether a running attempt is past its deadline (its handler is stuck)."""

    def overdue(self, attempt: Any) -> Report | None:
        """The report to send for an attempt written off past its deadline, or None if the store ends it."""

    def loop(self, name: str, step: Step, *, on_fatal: Callable[[str], None], stop: threading.Event | None) -> Loop:
        """A supervised loop for one of the worker's threads, waiting out this connector's outages."""

    def describe(self) -> str:
        """Who the worker is, for its log lines."""

    def banner(self) -> None:
        """Log the worker's start-up banner (runtime/logs.py: version, store, types, concurrency)."""
