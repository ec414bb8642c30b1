"""What a handler receives: the task's data and the calls it may make during its attempt.

The same TaskContext serves the local worker and the remote one. What differs is how an attempt
keeps its lease, so that sits behind an `AttemptChannel`: the local worker's writes the database
(`engine.attempts.DatabaseChannel`), the remote worker's calls the HTTP API
(`runtime.remote.HttpChannel`). This module imports no Django model, so a remote worker can use it
with no settings and no database.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, NoReturn, Protocol

from ..engine.progress import Progress, ProgressThrottle
from ..exceptions import LeaseLost, NextStage, PermanentFailure, Snooze
from .event_loop import blocking_executor

log = logging.getLogger("taskflow.worker")


class AttemptChannel(Protocol):
    """How a running attempt talks to whoever holds its task: extend the lease, save progress, hear a stop."""

    @property
    def deadline(self) -> datetime:
        """When the attempt times out unless extended."""

    @property
    def stop_requested(self) -> bool:
        """True once the attempt was taken away."""

    def heartbeat(self, checkpoint: Any = ..., progress: Progress | None = None) -> datetime:
        """Extend the deadline (saving `checkpoint` unless it is `...`, and `progress`); LeaseLost if taken away."""


class AttemptData(Protocol):
    """The attempt's task data a context exposes (engine.attempts.ClaimedTask or the remote worker's)."""

    id: int
    task_type: str
    key: str | None
    version: int
    priority: int
    payload: Any
    attempt: int
    max_retries: int
    stage: str
    context: Any
    checkpoint: Any
    trace_id: str
    worker_id: str


class TaskContext:
    """The running attempt of one task, handed to its handler."""

    def __init__(self, task: AttemptData, channel: AttemptChannel | None = None) -> None:
        if channel is None:
            # The local worker's channel; imported here so that this module stays free of the ORM.
            from ..engine.attempts import DatabaseChannel

            channel = DatabaseChannel(task)  # type: ignore[arg-type]
        self._channel = channel
        self._progress = ProgressThrottle()
        self.task_id = task.id
        self.task_type = task.task_type
        self.key = task.key
        self.version = task.version
        self.priority = task.priority
        self.payload = task.payload
        self.attempt = task.attempt
        self.max_retries = task.max_retries
        self.stage = task.stage
        self.context = task.context
        self.checkpoint = task.checkpoint
        self.trace_id = task.trace_id
        self.worker_id = task.worker_id

    @property
    def stop_requested(self) -> bool:
        """True once this attempt was taken away (an operator stopped the task, or it was rescued).

        Seen within about a second with Redis, else at the worker's next liveness beat (a remote
        worker: at its next beat to the server). A long handler should check it between steps and
        return: whatever it reports now is refused.
        """
        return self._channel.stop_requested

    @property
    def deadline(self) -> datetime:
        """When this attempt times out unless the handler heartbeats or saves a checkpoint."""
        return self._channel.deadline

    def heartbeat(self) -> None:
        """Extend this attempt's deadline by its timeout; raises LeaseLost if the task was taken away.

        In an async handler, `await ctx.aheartbeat()` (called here, it blocks the event loop while it writes).
        """
        self._write(progress=self._progress.take())

    def save_checkpoint(self, value: Any) -> None:
        """Persist progress (JSON) so a later attempt can resume; also extends the deadline."""
        self._write(value, progress=self._progress.take())
        self.checkpoint = value

    async def aheartbeat(self) -> None:
        """heartbeat() for an async handler: the write runs in a thread, so the event loop runs on."""
        await asyncio.to_thread(self._channel.heartbeat, progress=self._progress.take())

    async def asave_checkpoint(self, value: Any) -> None:
        """save_checkpoint() for an async handler: the write runs in a thread, so the event loop runs on."""
        await asyncio.to_thread(self._channel.heartbeat, value, progress=self._progress.take())
        self.checkpoint = value

    async def aprogress(self, done: float, total: float, message: str = "") -> None:
        """progress() for an async handler: a due write runs in a thread, so the event loop runs on."""
        due = self._progress.offer(done, total, message)
        if due is not None:
            await asyncio.to_thread(self._channel.heartbeat, progress=due)

    def _write(self, checkpoint: Any = ..., progress: Progress | None = None) -> datetime:
        """The channel's heartbeat; called on an event loop (a sync call in an async handler), made in a
        thread and waited for: correct (Django allows no database call on a loop), but it holds up the
        loop's other handlers meanwhile, which the awaitable variants do not."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._channel.heartbeat(checkpoint, progress)
        return _call_off_loop(loop, self._channel.heartbeat, checkpoint, progress)

    def progress(self, done: float, total: float, message: str = "") -> None:
        """Say how far this attempt got (`done` of `total`, numbers >= 0, `message` up to 200 characters).

        The console and the API show it; a new attempt starts with none. Call it as often as you
        like: it is written at most once a second (with a heartbeat, which also extends the
        deadline), and the last value when the handler returns. InvalidTask if malformed (done
        above total, say); LeaseLost, as heartbeat(), when a write finds the task taken away.
        """
        due = self._progress.offer(done, total, message)
        if due is not None:
            self._write(progress=due)

    def run(self, handler: Callable[[TaskContext], Any]) -> Any:
        """Call `handler` with this context; once it returns or raises, write its last progress (before the report)."""
        try:
            return handler(self)
        finally:
            self.flush_progress()

    async def arun(self, handler: Callable[[TaskContext], Awaitable[Any]]) -> Any:
        """Await the async `handler` with this context; then write its last progress, as run() does."""
        try:
            return await handler(self)
        finally:
            pending = self._progress.take()
            if pending is not None:
                await asyncio.to_thread(self._write_last_progress, pending)

    def flush_progress(self) -> None:
        """Write the last progress not yet written (the throttle may have held it back)."""
        pending = self._progress.take()
        if pending is not None:
            self._write_last_progress(pending)

    def _write_last_progress(self, pending: Progress) -> None:
        try:
            self._channel.heartbeat(progress=pending)
        except LeaseLost:
            pass  # the attempt was taken away: its report is refused too
        except Exception as exc:
            # The handler is done: what it returned or raised is the attempt's outcome, not this.
            log.warning("task %s: its last progress was not written: %s", self.task_id, exc)

    def snooze(self, delay: float, reason: str = "") -> NoReturn:
        """End this attempt and run again after `delay` seconds (0 to a year), without using up an attempt.

        Like fail() and next_stage(), raises InvalidTask instead when an argument is malformed; the
        worker then fails the task with that message.
        """
        raise Snooze(delay, reason)

    def fail(self, reason: str) -> NoReturn:
        """Fail the task permanently, whatever retries remain."""
        raise PermanentFailure(reason)

    def next_stage(
        self, stage: str, *, context: Any = None, delay: float = 0.0, priority: int | None = None
    ) -> NoReturn:
        """Requeue the task at `stage` (optionally with new context, delay and priority)."""
        raise NextStage(stage, context=context, delay=delay, priority=priority)


def _call_off_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> Any:
    """Call `fn` in another thread and wait for it: in the worker's I/O pool, or a thread of its own
    on a loop that is not a worker's (a test's asyncio.run, say), which ends with its connections."""
    executor = blocking_executor(loop)
    if executor is not None:
        return executor.submit(fn, *args).result()
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=call, name="taskflow-ctx-call")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
