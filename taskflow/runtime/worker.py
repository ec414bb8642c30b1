"""The local worker: the worker runtime (runner.py) over the database, through the engine.

`DatabaseConnector` is what the runtime needs of the database: claims (`claiming.claim_batch`, and
`claim_within_limit` for limited types; per task type on its own poll schedule), reports (`finishing.finish_attempts`,
which also gives limiter slots back), a liveness beat on a thread of its own, wake-ups and stop
notices (in-process, and through Redis pub/sub or PostgreSQL LISTEN when there is one). Each
thread drops a database connection that can no longer serve before using it
(`connections.drop_unusable`), so a database restart costs at most the attempts that were using it
at the time.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, close_old_connections
from django.utils import timezone

from ..conf import get_settings
from ..engine import registry, validation, wakeup
from ..engine.attempts import ClaimedTask, DatabaseChannel, Outcome, Report, lost_attempts
from ..engine.claiming import claim_batch, claim_within_limit, start_reserved
from ..engine.configs import configs
from ..engine.finishing import finish_attempts
from ..engine.limiter import Limiter
from ..engine.rescue import hand_back_unheld
from . import connections, logs
from .connector import Claim, Settle
from .liveness import LivenessBeat
from .runner import Runner, TooManyStuckHandlers, WorkerFailed
from .supervision import Loop, Step

__all__ = ["DatabaseConnector", "TooManyStuckHandlers", "Worker", "WorkerFailed", "new_worker_id"]

log = logging.getLogger("taskflow.worker")


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class DatabaseConnector:
    """The worker runtime's way to the database (see connector.Connector)."""

    def __init__(self, worker_id: str, select_types: Callable[[], list[str]] | None = None) -> None:
        self.worker_id = worker_id
        self.host = socket.gethostname()
        self.limiter = Limiter()
        self._select_types = select_types
        self._next_selection = 0.0
        self._lock = threading.Lock()
        self._backlog: set[str] = set()  # types whose last claim came back full
        self._woken: set[str] = set()
        self._next_poll: dict[str, float] = {}  # per type; set at its first round
        self._worker: Runner | None = None
        self._liveness: LivenessBeat | None = None
        # A claim raised: it may have committed with its answer lost (see between_claims).
        self._claim_unanswered = False
        self._next_hand_back = 0.0  # after a failed try, not before this (time.monotonic())

    @property
    def worker(self) -> Runner:
        assert self._worker is not None, "the connector is opened by its worker"
        return self._worker

    def describe(self) -> str:
        return f"worker {self.worker_id}"

    def banner(self) -> None:
        logs.worker_banner(self.worker)

    # -- threads -------------------------------------------------------------------------------

    def bind(self, worker: Runner) -> None:
        self._worker = worker

    def open(self) -> None:
        worker = self.worker
        self._liveness = LivenessBeat(
            self.worker_id,
            self.host,
            worker.task_types,
            worker.concurrency,
            on_fatal=worker.give_up,
            after_beat=self._notice_lost_attempts,
        )
        self._liveness.start()
        wakeup.add_local_listener(self._on_wakeup)
        wakeup.add_local_stop_listener(self._on_stop)
        # Redis pub/sub, PostgreSQL LISTEN or none; a listener that cannot go on stops the worker.
        wakeup.start_listener(self._on_wakeup, worker._done, self._on_stop, on_fatal=worker.give_up)

    def loop(self, name: str, step: Step, *, on_fatal: Callable[[str], None], stop: threading.Event | None) -> Loop:
        return connections.supervised(name, step, on_fatal=on_fatal, stop=stop)

    def stopping(self) -> None:
        wakeup.remove_local_listener(self._on_wakeup)
        wakeup.remove_local_stop_listener(self._on_stop)

    def halt(self) -> None:
        if self._liveness is not None:
            self._liveness.halt()

    def close(self, *, failed: bool) -> None:
        if self._liveness is not None:
            # A worker that must be restarted keeps its row: it looks dead, and taskwatch rescues
            # whatever it could not report.
            self._liveness.stop(forget=not failed)
        close_old_connections()

    def _on_stop(self, attempts: dict[int, int]) -> None:
        """Tell held attempts ({task id: lease token}) they were stopped: running handlers (ctx.stop_requested), and
        those started and waiting for a thread, which then do not run."""
        for task in self.worker.held_attempts():
            if attempts.get(task.id) == task.lease_token:
                task.stop_requested.set()

    def _notice_lost_attempts(self) -> None:
        """After each liveness beat: flag running attempts whose task was taken away (works without Redis)."""
        running = [t for t in self.worker.running_attempts() if not t.stop_requested.is_set()]
        for task in lost_attempts(running):
            task.stop_requested.set()

    def _on_wakeup(self, task_types: set[str]) -> None:
        with self._lock:
            self._woken.update(task_types or self.worker.task_types)
        self.worker.wake()

    # -- claiming ------------------------------------------------------------------------------

    def claim(
        self,
        room: int,
        ahead: int,
        capacity: int,
        busy: bool,
        task_types: list[str] | None = None,
        start_ahead: int = 0,
    ) -> Claim:
        self._add_new_types()
        try:
            tasks, reserved, soonest = self._claim_round(room, capacity, busy, ahead, task_types, start_ahead)
        except BaseException:
            self._claim_unanswered = True
            raise
        return Claim(tasks, soonest, reserved)

    def start(self, reserved: list[ClaimedTask]) -> list[ClaimedTask]:
        return start_reserved(reserved)

    def between_claims(self, held: list[Any]) -> None:
        """After a claim that raised, hand back what the database says this worker holds and it does not.

        A claim whose connection died as it committed, or a round that raised after claiming for
        another type, leaves attempts in the database under this worker that it never received.
        The worker still beats, so without this they would wait out their deadline (the task's
        timeout). Here no claim of this worker is in flight and `held` lists every attempt it
        holds (running, queued, reserved, being reported), so the others are safe to hand back.
        """
        if not self._claim_unanswered or time.monotonic() < self._next_hand_back:
            return
        try:
            handed = hand_back_unheld(self.worker_id, [(a.id, a.lease_token) for a in held])
        except DatabaseError as exc:
            # Still unreachable: tried again a second later (shutdown calls this every 50 ms).
            self._next_hand_back = time.monotonic() + 1.0
            log.warning("could not yet hand back attempts a failed claim may have left: %s", exc)
            return
        self._claim_unanswered = False
        if handed:
            log.warning("handed back %d task(s) claimed for this worker by a claim whose answer was lost", handed)

    def _add_new_types(self) -> None:
        """Serve the task types the worker's selection names now and did not before (e.g. a new queue)."""
        if self._select_types is None or time.monotonic() < self._next_selection:
            return
        self._next_selection = time.monotonic() + get_settings().CONFIG_REFRESH
        worker = self.worker
        new = [t for t in self._select_types() if t not in worker.task_types]
        if new:
            for task_type in new:
                registry.get_handler(task_type)  # the selection registered it; fail here if not
            # A new list, not an append: other threads read the old one meanwhile.
            worker.task_types = [*worker.task_types, *new]
            if self._liveness is not None:
                self._liveness.task_types = worker.task_types
            log.info("worker %s now also serves %s", self.worker_id, ",".join(new))

    def _claim_round(
        self,
        room: int,
        capacity: int,
        busy: bool,
        ahead: int = 0,
        task_types: list[str] | None = None,
        start_ahead: int = 0,
    ) -> tuple[list[ClaimedTask], list[ClaimedTask], float]:
        """Claim for every type that is due; returns what was claimed, what of it is reserved, and when next to look.

        Tasks of a limited type are never claimed ahead: a reserved task would hold a slot of its
        limit while no handler runs it, and slots are what limited types are short of. Of the others,
        as many as the worker would start right after the claim (`start_ahead`, START_AHEAD of work
        at its threads' pace) are started by the claim itself, saving the start UPDATE.
        """
        task_types = self.worker.task_types if task_types is None else task_types
        cfgs = configs.get_many(task_types)
        limits_all = get_settings().GLOBAL_CONCURRENCY_LIMIT > 0
        now = time.monotonic()
        claimed: list[ClaimedTask] = []
        reserved: list[ClaimedTask] = []
        used_room = 0  # attempts started for free threads
        starts_ahead = max(0, start_ahead)
        started_ahead = 0  # attempts of `ahead` started rather than reserved
        soonest = now + 1.0
        with self._lock:
            # Only these types' wake-ups: the others' are for a round that claims for them.
            woken = self._woken & set(task_types)
            self._woken -= woken
        order = task_types[:]
        random.shuffle(order)  # no type always goes first when slots are scarce
        for task_type in order:
            cfg = cfgs[task_type]
            interval = max(0.01, cfg.schedule_interval)
            if task_type not in self._next_poll:
                # Workers started together must not poll in step: each first polls at a random point
                # of its interval, capped at a second so a restart never leaves due work waiting for
                # a long interval (a burst worker looks at once; a wake-up makes anyone look at once).
                offset = random.random() * min(interval, 1.0)
                self._next_poll[task_type] = now if self.worker.burst else now + offset
            polled = now >= self._next_poll[task_type]
            due = polled or task_type in woken or task_type in self._backlog
            if cfg.paused or not due:
                soonest = min(soonest, self._next_poll[task_type]) if not cfg.paused else soonest
                continue
            limited = limits_all or cfg.concurrency_limit > 0
            free = max(0, room - used_room)
            extra = 0 if limited else max(0, ahead - len(reserved) - started_ahead)
            # While work is still running, wait for a worthwhile batch of free slots: claiming a
            # few tasks at a time would spend the worker on claim round trips instead of tasks.
            worthwhile = max(1, min(cfg.schedule_limit, capacity) // 4)
            if free + extra <= 0 or ((busy or claimed) and free + extra < worthwhile and task_type in self._backlog):
                self._backlog.add(task_type)  # a freed thread or a settled report wakes the loop
                continue
            wanted = min(free + extra, cfg.schedule_limit)
            tasks: list[ClaimedTask] = []
            if limited:
                tasks = claim_within_limit(cfg, wanted, self.worker_id, self.limiter, host=self.host)
                used_room += len(tasks)
            else:
                to_start = min(wanted, free + max(0, starts_ahead - started_ahead))
                tasks = claim_batch(cfg, to_start, self.worker_id, host=self.host, reserve=wanted - to_start)
                began = min(len(tasks), to_start)
                used_room += min(began, free)
                started_ahead += began - min(began, free)
                reserved += tasks[to_start:]
            claimed += tasks
            # A full batch means more is probably waiting: claim again when slots free up, or at
            # once if a worthwhile number are still free.
            if tasks and len(tasks) == wanted:
                self._backlog.add(task_type)
                if room + ahead - len(claimed) >= worthwhile:
                    soonest = now
            else:
                self._backlog.discard(task_type)
            if polled:
                # Only a poll moves the poll schedule, so wake-ups (which reach every worker at
                # once) do not bring workers back into step.
                self._next_poll[task_type] = now + interval * (0.9 + 0.2 * random.random())
            soonest = min(soonest, self._next_poll[task_type])
        return claimed, reserved, soonest

    # -- running and reporting -----------------------------------------------------------------

    def channel(self, attempt: ClaimedTask) -> DatabaseChannel:
        return DatabaseChannel(attempt)

    def prepare(self) -> None:
        connections.drop_unusable()

    def check_json(self, name: str, value: Any) -> int:
        return len(validation.json_text(name, value))

    def after_error(self, exc: BaseException) -> None:
        if isinstance(exc, DatabaseError) and not isinstance(exc, (DataError, IntegrityError)):
            connections.suspect_all()  # the server may have gone away for every thread

    def past_deadline(self, attempt: ClaimedTask) -> bool:
        return attempt.lease_expires_at < timezone.now()

    def overdue(self, attempt: ClaimedTask) -> Report | None:
        return None  # taskwatch takes it away (rescue_expired_attempts), by the database's clock

    def report(self, reports: list[Report], settle: Settle) -> None:
        try:
            accepted = finish_attempts(reports, limiter=self.limiter)
        except BaseException:
            # An outage stopped the flush part-way: what was written is done, the rest stays.
            written = [r for r in reports if r.written is not None]
            self._settled(written, written, settle)
            raise
        logs.attempts_ended(reports)
        refused = sum(1 for r in reports if r.outcome != Outcome.LOST) - len(accepted)
        if refused > 0:
            log.warning("%d stale report(s) refused (their attempts were taken away)", refused)
        self._settled(reports, accepted, settle)

    def _settled(self, reports: Sequence[Report], accepted: list[Report], settle: Settle) -> None:
        # A concurrency slot of a limited type freed here may let waiting tasks of it start: look
        # again now rather than at the next poll (slots freed by other workers wait for a poll).
        limited = {r.task.task_type for r in accepted} & self._limited_types()
        if limited:
            with self._lock:
                self._woken |= limited
        settle(reports, accepted)

    def _limited_types(self) -> set[str]:
        cfgs = configs.get_many(self.worker.task_types)
        if get_settings().GLOBAL_CONCURRENCY_LIMIT > 0:
            return set(cfgs)
        return {task_type for task_type, cfg in cfgs.items() if cfg.concurrency_limit > 0}


class Worker(Runner):
    """Claims due tasks from the database, runs their handlers in a thread pool (async ones on an event loop),
    reports results in batches."""

    def __init__(
        self,
        task_types: Iterable[str] | None = None,
        *,
        concurrency: int = 8,
        burst: bool = False,
        grace: float | None = None,
        worker_id: str | None = None,
        max_stuck: int | None = None,
        select_types: Callable[[], list[str]] | None = None,
        prefetch: int | None = None,
        async_concurrency: int | None = None,
    ) -> None:
        """`select_types`: how the task types were chosen, asked again every CONFIG_REFRESH for new ones
        (a django.tasks queue first used after the worker started, say)."""
        settings = get_settings()
        self.worker_id = worker_id or new_worker_id()
        self.host = socket.gethostname()
        self.connector: DatabaseConnector = DatabaseConnector(self.worker_id, select_types)
        self.limiter = self.connector.limiter
        super().__init__(
            self.connector,
            task_types,
            concurrency=concurrency,
            burst=burst,
            grace=settings.SHUTDOWN_GRACE if grace is None else grace,
            max_stuck=max_stuck,
            flush_timeout=10.0,
            report_interval=settings.REPORT_INTERVAL,
            prefetch=settings.PREFETCH if prefetch is None else prefetch,
            prefetch_wait=settings.PREFETCH_WAIT,
            async_concurrency=settings.ASYNC_CONCURRENCY if async_concurrency is None else async_concurrency,
        )
