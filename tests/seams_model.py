"""A plain in-memory model of what taskflow promises, for the seams test (tests/test_seams.py).

It knows nothing of SQL, Redis or the engine's modules: only the rules the README and docs/ state
(identity and versions, dependencies, attempts and retries, operator operations, concurrency
limits, rolling and retention). The test applies every operation to the engine and to this model,
and compares them after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WAITING, PENDING, PROCESSING = "waiting", "pending", "processing"
SUCCESS, FAILED, STOPPED = "success", "failed", "stopped"
FINISHED = frozenset({SUCCESS, FAILED, STOPPED})
BROKEN = frozenset({FAILED, STOPPED})

# How long ago a finished task finished, as the test ages it: "fresh" stays in the task table,
# "old" is past ROLL_AFTER (it rolls), "ancient" is past ROLL_RETENTION_DAYS too (its table drops).
FRESH, OLD, ANCIENT = "fresh", "old", "ancient"


class Refused(Exception):
    """What the model expects the engine to refuse (StaleVersion, InvalidTask), with why."""


@dataclass
class MTask:
    label: str  # t1, t2, ... in the order the model created them: what failure messages show
    task_type: str
    key: str | None
    version: int
    status: str
    deps: tuple[str, ...] = ()  # labels of the tasks it depends on
    run_on_failure: bool = False
    # How each dependency had finished when this task saw it finish: a dependency re-enqueued in
    # place later (same id) does not make its dependent wait again.
    seen: dict[str, str] = field(default_factory=dict)
    future: bool = False  # its due time is far ahead: no claim takes it
    attempts: int = 0
    max_retries: int | None = None  # the task's own value (None: its type's)
    priority: int = 0
    superseded: bool = False  # a newer version was enqueued while this one ran
    holder: tuple[str, int] | None = None  # (attempt label, lease) of the attempt holding it while processing
    table: int | None = None  # the history table holding it (None: the task table)
    age: str = FRESH


@dataclass
class MAttempt:
    label: str  # a1, a2, ...
    task: str  # task label
    task_type: str
    via: str  # "local" or "remote"
    lease: int
    running: bool = True  # the handler has not returned and its deadline has not passed
    terminated: bool = False  # an operator stopped its task while the handler still ran


@dataclass
class MTable:
    position: int
    tasks: set[str] = field(default_factory=set)
    all_ancient: bool = True  # every task ever moved into it finished ROLL_RETENTION_DAYS ago
    moved: int = 0
    dropped: bool = False


@dataclass
class Model:
    limits: dict[str, int]  # concurrency_limit per task type (0: none)
    type_max_retries: dict[str, int]
    tasks: dict[str, MTask] = field(default_factory=dict)
    heads: dict[tuple[str, str], int] = field(default_factory=dict)  # newest version accepted per key
    attempts: dict[str, MAttempt] = field(default_factory=dict)
    tables: list[MTable] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)  # tasks gone with a dropped history table
    next_position: int = 1

    # -- reading -------------------------------------------------------------------------------------

    def live(self) -> list[MTask]:
        return [t for t in self.tasks.values() if t.label not in self.dropped]

    def running(self, task_type: str | None = None) -> list[MAttempt]:
        """Handlers running now: they hold a concurrency slot, and their task may not start again."""
        return [a for a in self.attempts.values() if a.running and (task_type is None or a.task_type == task_type)]

    def identity(self, task_type: str, key: str, version: int) -> MTask | None:
        for t in self.live():
            if (t.task_type, t.key, t.version) == (task_type, key, version):
                return t
        return None

    def room(self, task_type: str) -> int | None:
        limit = self.limits.get(task_type, 0)
        return None if not limit else max(0, limit - len(self.running(task_type)))

    def claimable(self, task_type: str) -> list[MTask]:
        return [
            t
            for t in self.live()
            if t.task_type == task_type and t.status == PENDING and not t.future and t.table is None
        ]

    def max_retries(self, task: MTask) -> int:
        return self.type_max_retries[task.task_type] if task.max_retries is None else task.max_retries

    def superseded(self, task: MTask) -> bool:
        return task.key is not None and self.heads.get((task.task_type, task.key), task.version) > task.version

    def blocked(self, task: MTask) -> bool:
        """A finished task may not run again while a dependency it needs has not succeeded."""
        for dep in task.deps:
            if dep in self.dropped:
                continue  # gone with its table, edges and all
            status = self.tasks[dep].status
            if status == SUCCESS or (task.run_on_failure and status in FINISHED):
                continue
            return True
        return False

    def dependents(self, label: str) -> list[MTask]:
        return [t for t in self.live() if label in t.deps]

    # -- enqueueing ------------------------------------------------------------------------------------

    def initial_status(self, deps: tuple[str, ...], run_on_failure: bool, seen: dict[str, str] | None = None) -> str:
        statuses = [(seen or {}).get(d) or self.tasks[d].status for d in deps]
        if not run_on_failure and any(s in BROKEN for s in statuses):
            return STOPPED
        if any(s not in FINISHED for s in statuses):
            return WAITING
        return PENDING

    def enqueue(
        self,
        label: str,
        task_type: str,
        key: str | None,
        version: int,
        deps: tuple[str, ...],
        run_on_failure: bool,
        future: bool,
    ) -> tuple[MTask, str]:
        """Apply an enqueue; returns the task and "created", "existing" or "replaced". Raises Refused."""
        gone = [d for d in deps if d in self.dropped]
        if gone:
            raise Refused(f"depends_on names task(s) dropped with their history table: {gone}")
        if key is None:
            return self._create(label, task_type, None, 0, deps, run_on_failure, future), "created"
        head = self.heads.get((task_type, key))
        if head is not None and version < head:
            raise Refused(f"stale version {version} < {head}")
        existing = self.identity(task_type, key, version)
        if existing is not None and existing.status not in (FAILED, STOPPED):
            return existing, "existing"
        if existing is not None:
            if existing.label in deps:
                raise Refused("a task re-enqueued in place cannot depend on itself")
            if deps and self.dependents(existing.label):
                raise Refused("a task re-enqueued in place with dependents cannot be given dependencies")
            # Stopped while its handler ran: the new run waits for that handler's deadline.
            future = future or (existing.status == STOPPED and self.handler_runs(existing))
            existing.status = self.initial_status(deps, run_on_failure)
            existing.seen = self._seen(deps)
            existing.deps, existing.run_on_failure, existing.future = deps, run_on_failure, future
            existing.attempts, existing.max_retries, existing.priority = 0, None, 0
            existing.table, existing.age, existing.superseded = None, FRESH, False
            self._leave_table(existing)
            task, outcome = existing, "replaced"
        else:
            task, outcome = self._create(label, task_type, key, version, deps, run_on_failure, future), "created"
        self.heads[(task_type, key)] = max(version, head or version)
        for older in self.live():
            if older.task_type == task_type and older.key == key and older.version < version and older.table is None:
                if older.status in (PENDING, WAITING):
                    older.status = STOPPED
                elif older.status == PROCESSING:
                    older.superseded = True
        self.settle()
        return task, outcome

    def _create(self, label, task_type, key, version, deps, run_on_failure, future) -> MTask:  # noqa: ANN001
        task = MTask(label, task_type, key, version, self.initial_status(deps, run_on_failure), deps, run_on_failure)
        task.future, task.seen = future, self._seen(deps)
        self.tasks[label] = task
        return task

    def _seen(self, deps: tuple[str, ...]) -> dict[str, str]:
        return {d: self.tasks[d].status for d in deps if self.tasks[d].status in FINISHED}

    def unroll(self, task: MTask) -> None:
        """The task is back in the task table, unchanged (it rolls again at the next roll)."""
        self._leave_table(task)
        task.table = None

    def _leave_table(self, task: MTask) -> None:
        for table in self.tables:
            table.tasks.discard(task.label)

    # -- attempts ------------------------------------------------------------------------------------

    def claimed(self, attempt: MAttempt) -> list[str]:
        """Record a claim the engine made; returns the promises it broke."""
        broken = []
        task = self.tasks[attempt.task]
        others = [a.label for a in self.running() if a.task == task.label]
        if others:
            broken.append(f"{task.label} claimed again while its attempt {others} still runs (two live attempts)")
        if task.status != PENDING or task.future or task.table is not None:
            broken.append(f"{task.label} claimed while the model has it {task.status}, future={task.future}")
        self.attempts[attempt.label] = attempt
        task.status, task.holder = PROCESSING, (attempt.label, attempt.lease)
        task.attempts += 1
        limit = self.limits.get(task.task_type, 0)
        if limit and len(self.running(task.task_type)) > limit:
            broken.append(
                f"concurrency_limit {limit} of {task.task_type} exceeded: "
                f"{[a.label for a in self.running(task.task_type)]} run at once"
            )
        return broken

    def holds(self, attempt: MAttempt) -> bool:
        task = self.tasks[attempt.task]
        return task.status == PROCESSING and task.holder == (attempt.label, attempt.lease)

    def report(self, attempt: MAttempt, outcome: str, future: bool = False) -> bool:
        """The handler of `attempt` returned with `outcome`; returns whether the report must be accepted."""
        attempt.running = False
        if not self.holds(attempt):
            return False
        self._end(self.tasks[attempt.task], outcome, future)
        return True

    def rescued(self, attempt: MAttempt) -> None:
        """The attempt's deadline passed and taskwatch took it away: a failed attempt."""
        attempt.running = False
        self._end(self.tasks[attempt.task], "error", False)

    def handed_back(self, attempt: MAttempt) -> None:
        """The attempt was never started (its claim's answer was lost): pending in its place, uncounted."""
        attempt.running = False
        self._end(self.tasks[attempt.task], "snooze", False)  # a snooze of no delay, as far as the task can tell

    def _end(self, task: MTask, outcome: str, future: bool) -> None:
        task.holder = None
        if outcome == "error" and task.attempts > self.max_retries(task):
            outcome = "fail"
        if outcome == "success":
            task.status = SUCCESS
        elif outcome == "fail":
            task.status = FAILED
        elif outcome in ("error", "snooze", "next_stage"):
            # Requeued; a task a newer version superseded while it ran stops instead.
            task.status = STOPPED if task.superseded else PENDING
            task.future = future
            if outcome == "snooze":
                task.attempts -= 1
            elif outcome == "next_stage":
                task.attempts = 0
        else:
            raise AssertionError(outcome)
        task.age = FRESH
        self.settle()

    # -- operator operations ---------------------------------------------------------------------------

    def terminate(self, task: MTask) -> bool:
        if task.status in (PENDING, WAITING):
            task.status = STOPPED
        elif task.status == PROCESSING:
            task.status = STOPPED
            for a in self.attempts.values():
                if (a.label, a.lease) == task.holder:
                    a.terminated = True  # its handler runs on, holding its slot, until it returns
            task.holder = None
        else:
            return False
        task.age = FRESH
        self.settle()
        return True

    def revivable(self, task: MTask, *, delay_only: bool) -> bool:
        """Whether retry_now (delay_only: a delayed pending task becomes due) or reschedule changes the task."""
        if task.status == PENDING:
            return (task.future or not delay_only) and not self.handler_runs(task)
        if task.status == WAITING:
            return not delay_only and not self.handler_runs(task)
        if task.status in (FAILED, STOPPED):
            return not (self.superseded(task) or self.blocked(task) or self.handler_runs(task))
        return False

    def handler_runs(self, task: MTask) -> bool:
        """Whether the handler of an attempt an operator stopped still runs (running it again would run it twice)."""
        return any(a.running and a.task == task.label for a in self.attempts.values())

    def revive(self, task: MTask, future: bool) -> None:
        """Apply retry_now or reschedule to a task `revivable` chose (a rolled one comes back to the task table)."""
        task.future = future
        if task.status in (FAILED, STOPPED):
            self._leave_table(task)
            task.status, task.attempts, task.table, task.age = PENDING, 0, None, FRESH

    # -- dependencies ----------------------------------------------------------------------------------

    def settle(self) -> None:
        """Release waiting dependents whose dependencies finished, down the graph."""
        changed = True
        while changed:
            changed = False
            for task in self.live():
                if task.status != WAITING:
                    continue
                for dep, status in self._seen(task.deps).items():
                    task.seen.setdefault(dep, status)
                status = self.initial_status(task.deps, task.run_on_failure, task.seen)
                if status != WAITING:
                    task.status, changed = status, True

    # -- rolling ---------------------------------------------------------------------------------------

    def roll(self) -> tuple[list[int], list[str]]:
        """Drop expired history tables, then move old finished tasks; returns (positions dropped, tasks moved)."""
        dropped = []
        for table in self.tables:
            if not table.dropped and table.moved and table.all_ancient:
                table.dropped = True
                dropped.append(table.position)
                self.dropped |= table.tasks
        for label in self.dropped:
            for t in self.tasks.values():
                if label in t.deps:
                    t.deps = tuple(d for d in t.deps if d != label)
        moving = [t for t in self.live() if t.table is None and t.status in FINISHED and t.age != FRESH]
        if moving:
            kept = [t for t in self.tables if not t.dropped]
            if not kept:
                kept = [MTable(self.next_position)]
                self.tables.append(kept[0])
                self.next_position += 1
            current = kept[-1]
            for t in moving:
                t.table = current.position
                current.tasks.add(t.label)
                current.moved += 1
                current.all_ancient &= t.age == ANCIENT
        return dropped, [t.label for t in moving]
