"""Tables: tasks, per-type schedule configuration, rolling positions, and the coordination rows."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q, Value

from .conf import get_settings, value_range
from .engine import ids
from .engine.validation import MAX_PRIORITY, MIN_PRIORITY


class Status(models.TextChoices):
    WAITING = "waiting"  # for its dependencies (engine/dependencies.py); never claimed
    PENDING = "pending"
    PROCESSING = "processing"
    SUCCESS = "success"
    FAILED = "failed"
    STOPPED = "stopped"


class RetryStrategy(models.TextChoices):
    FIXED = "fixed", "fixed interval"
    EXPONENTIAL = "exponential", "exponential with cap"
    POLYNOMIAL = "polynomial", "Sidekiq-style polynomial"


SCHEDULE_LOG_SIZE = 6  # the last attempt plus the previous five


class Task(models.Model):
    """One unit of asynchronous work; every state change is an UPDATE of this row."""

    # A db_default beside a default: the columns a new task leaves at their default, which the
    # enqueue INSERT leaves out for the database to fill (engine/sql.py). The ORM is unaffected.

    id = models.BigIntegerField(primary_key=True, default=ids.next_id, editable=False)
    task_type = models.CharField(max_length=100)
    # NULL when the producer gave no key: such tasks have no identity and never deduplicate.
    key = models.CharField(max_length=255, null=True, blank=True, db_column="task_key")
    version = models.BigIntegerField(default=0, db_default=0)
    # Set by the enqueue of a newer version while this one waits or runs; a running attempt's
    # retry, snooze or next stage then stops the task instead of queueing it again.
    superseded_by = models.BigIntegerField(null=True, blank=True, help_text="the newer version that replaced this one")
    priority = models.SmallIntegerField(default=0, db_default=0, help_text="-100..100, higher runs first")

    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING, db_default=Status.PENDING)
    status_msg = models.TextField(blank=True, default="", db_default="")

    payload = models.JSONField(default=dict, blank=True)
    result = models.JSONField(null=True, blank=True)
    context = models.JSONField(
        default=dict, db_default=Value("{}"), blank=True, help_text="working data carried between stages"
    )
    checkpoint = models.JSONField(null=True, blank=True)
    # The running (or last) attempt's ctx.progress() with its lease token: engine/progress.py.
    progress = models.JSONField(null=True, blank=True)
    stage = models.CharField(max_length=100, blank=True, default="", db_default="")

    attempts = models.PositiveIntegerField(default=0, db_default=0)
    # NULL means "use the task type's current ScheduleCfg value", so live config edits apply.
    max_retries = models.PositiveIntegerField(null=True, blank=True)
    timeout = models.PositiveIntegerField(null=True, blank=True, help_text="seconds per attempt")

    run_after = models.DateTimeField()
    # The scheduling key: due time moved earlier by priority x the type's aging, so higher
    # priority runs first but an old low-priority task eventually overtakes a flood of new ones.
    order_time = models.DateTimeField()

    worker_id = models.CharField(max_length=200, blank=True, default="", db_default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Fencing token: incremented whenever an attempt starts or is taken away, and required by
    # every report, so a late report from a lost attempt changes nothing.
    lease_token = models.PositiveBigIntegerField(default=0, db_default=0)

    # Host affinity: a task with retry_same_host > 0 is retried on the host that first ran it, for
    # that many seconds after each failure, then anywhere (prefer_host/_until hold the current wish).
    retry_same_host = models.PositiveIntegerField(default=0, db_default=0, help_text="seconds; 0 = any host")
    prefer_host = models.CharField(max_length=200, blank=True, default="", db_default="")
    prefer_host_until = models.DateTimeField(null=True, blank=True)

    trace_id = models.CharField(max_length=32, blank=True, default="")
    schedule_log = models.JSONField(default=list, db_default=Value("[]"), blank=True)
    user_id = models.CharField(max_length=64, blank=True, default="", db_default="")

    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    # Not a column: on each task taskflow.enqueue/enqueue_many return, "created", "existing" or "replaced".
    enqueue_outcome: str

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task_type", "key", "version"], name="taskflow_task_identity"),
            models.CheckConstraint(
                condition=Q(priority__gte=MIN_PRIORITY, priority__lte=MAX_PRIORITY),
                name="taskflow_task_priority_range",
            ),
        ]
        indexes = [
            # Every index holding `status` is rewritten at each transition, so there are few:
            # claims read this one, and the small processing set (rescues) is its prefix too.
            models.Index(fields=["status", "task_type", "order_time"], name="taskflow_claim_idx"),
            # Retention and purge of finished tasks; pending/processing rows sit under NULL.
            models.Index(fields=["status", "finished_at"], name="taskflow_finished_idx"),
            models.Index(fields=["task_type", "created_at"], name="taskflow_type_created_idx"),
            # The console's filters and search (docs/console.md): none holds status, so transitions
            # leave them alone; stage and priority change only when an operator or a stage does.
            models.Index(fields=["task_type", "stage"], name="taskflow_type_stage_idx"),
            models.Index(fields=["task_type", "priority"], name="taskflow_type_priority_idx"),
            models.Index(fields=["trace_id"], name="taskflow_trace_idx"),
            models.Index(fields=["user_id"], name="taskflow_user_idx"),
        ]
        permissions = [
            ("operate_task", "Can stop, retry, reschedule and re-prioritise tasks"),
            ("hold_task", "Can hold tasks and report on them as a remote worker"),
        ]

    def save(self, *args: Any, **kwargs: Any) -> None:
        # A task read from a history table (taskflow.get_task) is a read-only copy: saving it would
        # insert a second row with its id into the hot table.
        if getattr(self, "history_position", None) is not None:
            raise ValueError(f"task {self.pk} lives in history table {self.history_position}: it is read-only")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        ident = f" {self.key}@v{self.version}" if self.key else ""
        return f"{self.task_type}#{self.id}{ident} [{self.status}]"


class TaskKey(models.Model):
    """The newest version seen for one (task_type, key).

    Its row lock serialises enqueues of the same identity, so concurrent requests with different
    versions are ordered even before any task row exists. Never deleted: every task of a key was
    inserted under its head row, so a missing head means a brand-new key.
    """

    task_type = models.CharField(max_length=100)
    key = models.CharField(max_length=255, db_column="task_key")
    version = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task_type", "key"], name="taskflow_taskkey_identity")]

    def __str__(self) -> str:
        return f"{self.task_type}/{self.key}@v{self.version}"


class TaskDependency(models.Model):
    """One edge of the dependency graph: task `task_id` waits for task `depends_on_id` (engine/dependencies.py).

    Not foreign keys, like TaskEvent: a task's rows may be purged or moved while edges are shown.
    `outcome` is empty while the edge is open and holds the dependency's final status once the
    release has seen it, so a success later expired to stopped still counts as a success.
    """

    task_id = models.BigIntegerField(help_text="the dependent task")
    depends_on_id = models.BigIntegerField(help_text="the task it waits for")
    run_on_failure = models.BooleanField(default=False, help_text="on_dependency_failure='run'")
    outcome = models.CharField(max_length=10, blank=True, default="")

    class Meta:
        verbose_name = "task dependency"
        verbose_name_plural = "task dependencies"
        constraints = [models.UniqueConstraint(fields=["task_id", "depends_on_id"], name="taskflow_dependency_edge")]
        indexes = [
            # dependency -> dependents (the release); the unique constraint serves dependent -> dependencies.
            models.Index(fields=["depends_on_id", "task_id"], name="taskflow_dependents_idx"),
            # The open edges, by dependency: the watcher's repair reads only these.
            models.Index(fields=["outcome", "depends_on_id"], name="taskflow_dependency_open_idx"),
        ]

    def __str__(self) -> str:
        return f"#{self.task_id} waits for #{self.depends_on_id}"


def _within(setting: str) -> list[Any]:
    """Validators keeping a field in the range of its TASKFLOW default setting."""
    low, high = value_range(setting)
    return [MinValueValidator(low), MaxValueValidator(high)]


class ScheduleCfg(models.Model):
    """How one task type is scheduled; created with defaults on first use and editable live.

    Each field has the range of its TASKFLOW default (conf.TaskflowSettings), so the admin refuses
    a value a worker could not run with.
    """

    task_type = models.CharField(max_length=100, primary_key=True)
    schedule_limit = models.PositiveIntegerField(
        default=100, validators=_within("SCHEDULE_LIMIT"), help_text="max tasks per claim (1-1000)"
    )
    schedule_interval = models.FloatField(
        default=1.0, validators=_within("SCHEDULE_INTERVAL"), help_text="seconds between polls"
    )
    max_processing_time = models.PositiveIntegerField(
        default=300, validators=_within("MAX_PROCESSING_TIME"), help_text="seconds per attempt"
    )
    max_retry_num = models.PositiveIntegerField(default=3, validators=_within("MAX_RETRY_NUM"))
    retry_strategy = models.CharField(max_length=12, choices=RetryStrategy.choices, default=RetryStrategy.EXPONENTIAL)
    retry_interval = models.FloatField(
        default=10.0, validators=_within("RETRY_INTERVAL"), help_text="seconds: base delay"
    )
    max_retry_interval = models.FloatField(
        default=3600.0, validators=_within("MAX_RETRY_INTERVAL"), help_text="seconds: cap on any delay"
    )
    retry_jitter = models.FloatField(
        default=0.1, validators=_within("RETRY_JITTER"), help_text="fraction of the delay randomly taken off (0-1)"
    )
    concurrency_limit = models.PositiveIntegerField(
        default=0, validators=_within("CONCURRENCY_LIMIT"), help_text="0 = unlimited"
    )
    priority_aging = models.FloatField(
        default=1.0, validators=_within("PRIORITY_AGING"), help_text="seconds of head start per priority point"
    )
    pending_timeout = models.PositiveIntegerField(
        default=0, validators=_within("PENDING_TIMEOUT"), help_text="seconds; 0 = never"
    )
    success_retention = models.PositiveIntegerField(
        default=86400, validators=_within("SUCCESS_RETENTION"), help_text="seconds before success becomes stopped"
    )
    purge_after_days = models.PositiveIntegerField(
        default=7, validators=_within("PURGE_AFTER_DAYS"), help_text="failed/stopped older than this are deleted"
    )
    paused = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "schedule config"

    def __str__(self) -> str:
        return self.task_type

    def clean_fields(self, exclude: Iterable[str] | None = None) -> None:
        """Field validators, plus what they cannot say: floats are finite, the retry base is under its cap."""
        # Here rather than in clean(): a form showing only some fields (the list's editable
        # columns) excludes the others, and an error keyed to an excluded field cannot be shown.
        skip = set(exclude or ())
        errors: dict[str, list[ValidationError]] = {}
        try:
            super().clean_fields(exclude=exclude)
        except ValidationError as exc:
            errors = exc.error_dict
        checked = skip | set(errors)
        for f in self._meta.concrete_fields:
            value = getattr(self, f.attname)
            if isinstance(f, models.FloatField) and f.name not in checked and not math.isfinite(value):
                errors[f.name] = [ValidationError("Enter a finite number.", code="invalid")]
        pair = ("retry_interval", "max_retry_interval")
        shown = [name for name in pair if name not in skip]
        if shown and not errors.keys() & set(pair) and self.retry_interval > self.max_retry_interval:
            errors[shown[0]] = [
                ValidationError(
                    "The retry interval (%(base)g s) must not exceed the max retry interval (%(cap)g s), "
                    "the cap on every delay.",
                    code="max_value",
                    params={"base": self.retry_interval, "cap": self.max_retry_interval},
                )
            ]
        if errors:
            raise ValidationError(errors)

    @classmethod
    def from_settings(cls, task_type: str) -> ScheduleCfg:
        s = get_settings()
        return cls(
            task_type=task_type,
            schedule_limit=s.SCHEDULE_LIMIT,
            schedule_interval=s.SCHEDULE_INTERVAL,
            max_processing_time=s.MAX_PROCESSING_TIME,
            max_retry_num=s.MAX_RETRY_NUM,
            retry_strategy=s.RETRY_STRATEGY,
            retry_interval=s.RETRY_INTERVAL,
            max_retry_interval=s.MAX_RETRY_INTERVAL,
            retry_jitter=s.RETRY_JITTER,
            concurrency_limit=s.CONCURRENCY_LIMIT,
            priority_aging=s.PRIORITY_AGING,
            pending_timeout=s.PENDING_TIMEOUT,
            success_retention=s.SUCCESS_RETENTION,
            purge_after_days=s.PURGE_AFTER_DAYS,
        )


class SchedulePos(models.Model):
    """One numbered history table of the task table (`<task table>_<position>`), as rolling fills and drops it.

    The lowest position not dropped is the oldest table still kept; the highest is the one being
    filled now. `min_id`..`max_id` bound the ids it holds, so a task id tells which tables to look
    in (engine/rolling.py). Rows stay after their table is dropped, so positions are never reused.
    """

    position = models.PositiveIntegerField(primary_key=True)
    started_at = models.DateTimeField()
    row_count = models.BigIntegerField(default=0, help_text="rows the table holds now")
    min_id = models.BigIntegerField(null=True, blank=True)
    max_id = models.BigIntegerField(null=True, blank=True)
    newest_finished_at = models.DateTimeField(null=True, blank=True, help_text="retention drops the table after this")
    # Set before the table is dropped: from then on nothing reads or writes it.
    dropped_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField()

    class Meta:
        verbose_name = "history table"

    def __str__(self) -> str:
        state = "dropped" if self.dropped_at else f"{self.row_count} rows"
        return f"history table {self.position} ({state})"


class Lock(models.Model):
    """A named lease held by an owner until it expires (the no-Redis fallback of taskflow.locks)."""

    name = models.CharField(max_length=200, primary_key=True)
    owner = models.CharField(max_length=200)
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name} -> {self.owner}"


class IdNode(models.Model):
    """One of the id generator's 1,024 node numbers, leased by one process at a time (engine/nodes.py).

    Rows are never deleted: `mint_limit` must outlive its holder, so the next one starts above it.
    """

    node = models.PositiveSmallIntegerField(primary_key=True)
    owner = models.CharField(max_length=200, blank=True, default="")
    expires_at = models.DateTimeField()
    # Ids under this node have timestamps up to here (Unix ms); the holder records a new limit
    # before passing it, and the next holder mints only above it, whatever its clock says.
    mint_limit = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"id node {self.node} -> {self.owner or '(free)'}"


class WorkerProcess(models.Model):
    """A live worker process, heartbeating on its own so a dead one is noticed quickly."""

    worker_id = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    task_types = models.JSONField(default=list)
    concurrency = models.PositiveIntegerField(default=1)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField(db_index=True)

    class Meta:
        verbose_name = "worker"

    def __str__(self) -> str:
        return self.worker_id


class TaskEvent(models.Model):
    """One change to a task that an operator would want to see: who did what, when and why.

    Written in the same transaction as the change it records. `task_id` is not a foreign key: a
    task's history outlives the row (purged, or moved to a history table), and events about many
    tasks at once (a purge) have none.
    """

    task_id = models.BigIntegerField(null=True, blank=True)
    at = models.DateTimeField()
    actor = models.CharField(max_length=200, help_text="the user or process that made the change")
    action = models.CharField(max_length=40)
    reason = models.TextField(blank=True, default="")
    # {"field": [before, after], ...}, or for a bulk event {"count": n, ...}
    changes = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = "task event"
        indexes = [
            models.Index(fields=["task_id", "at"], name="taskflow_event_task_idx"),
            models.Index(fields=["at"], name="taskflow_event_at_idx"),
            # The console's event filters.
            models.Index(fields=["action", "at"], name="taskflow_event_action_idx"),
            models.Index(fields=["actor", "at"], name="taskflow_event_actor_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} #{self.task_id}"


class PeriodicTask(models.Model):
    """A recurring schedule that the taskwatch leader turns into one task per tick (engine/periodic.py).

    Rows come from TASKFLOW["PERIODIC"], from `taskflow.periodic(...)` in code, or from the console.
    Each tick's task has key "periodic:<name>" and the tick's Unix time as its version.
    """

    name = models.CharField(max_length=100, primary_key=True, help_text="letters, digits, '_', '.' and '-'")
    task_type = models.CharField(max_length=100)
    cron = models.CharField(
        max_length=200, blank=True, default="", help_text='five fields, e.g. "*/5 * * * *" (or set "every")'
    )
    every = models.PositiveIntegerField(null=True, blank=True, help_text="seconds between ticks (or set a cron)")
    timezone = models.CharField(max_length=64, default="UTC", help_text="the zone the cron is read in")
    payload = models.JSONField(default=dict, blank=True)
    priority = models.SmallIntegerField(default=0, help_text="-100..100, higher runs first")
    catch_up = models.PositiveIntegerField(
        default=0,
        help_text="when several ticks are due, run the latest N one after another; 0 = only the latest",
    )
    enabled = models.BooleanField(default=True)

    # "settings", "code" or "console"; a declared row follows its declaration whenever that changes
    # (declared_hash is the declaration last applied), and keeps console edits in between.
    source = models.CharField(max_length=10, default="console", editable=False)
    declared_hash = models.CharField(max_length=64, blank=True, default="", editable=False)
    # Every tick at or before this Unix second was fired or deliberately skipped.
    settled_until = models.BigIntegerField(default=0, editable=False)
    next_run_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_run_at = models.DateTimeField(null=True, blank=True, editable=False, help_text="the last fired tick")
    last_task_id = models.BigIntegerField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "periodic task"
        indexes = [models.Index(fields=["enabled", "next_run_at"], name="taskflow_periodic_due_idx")]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """The engine's checks on a schedule, each error shown at its field."""
        from .engine.periodic import schedule_errors

        errors = schedule_errors(self)
        if errors:
            raise ValidationError(errors)


class TaskStats(models.Model):
    """The dashboard's rollup of one task type, refreshed by taskwatch (engine/stats.py).

    `totals` only ever grows (finished minutes are added once), so the metrics' counters built
    from it never go backwards.
    """

    task_type = models.CharField(max_length=100, primary_key=True)
    counts = models.JSONField(default=dict, blank=True, help_text="tasks by status when last counted")
    counted_at = models.DateTimeField(null=True, blank=True)
    count_seconds = models.FloatField(default=0.0, help_text="how long the last count took")
    in_flight = models.PositiveIntegerField(default=0)
    # The due time of the next pending task to be claimed (the head of the queue), if one is due.
    oldest_pending_since = models.DateTimeField(null=True, blank=True)
    # Minutes before this are final and added to `totals`.
    rolled_until = models.DateTimeField(null=True, blank=True)
    totals = models.JSONField(default=dict, blank=True)
    refreshed_at = models.DateTimeField()

    class Meta:
        verbose_name = "task statistics"
        verbose_name_plural = "task statistics"

    def __str__(self) -> str:
        return f"stats of {self.task_type}"


class TaskStatsMinute(models.Model):
    """What one task type finished in one minute (by finish time), and how long those attempts ran."""

    task_type = models.CharField(max_length=100)
    minute = models.DateTimeField()
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    stopped = models.PositiveIntegerField(default=0)
    attempts = models.PositiveBigIntegerField(default=0, help_text="attempts run by the tasks finished")
    # Counts per bucket of engine.stats.RUN_TIME_BOUNDS_MS (plus one past the last bound).
    run_time_buckets = models.JSONField(default=list, blank=True)
    run_time_sum_ms = models.FloatField(default=0.0)

    class Meta:
        verbose_name = "task statistics minute"
        constraints = [models.UniqueConstraint(fields=["task_type", "minute"], name="taskflow_statsminute_key")]
        indexes = [models.Index(fields=["minute"], name="taskflow_statsminute_idx")]

    def __str__(self) -> str:
        return f"{self.task_type} {self.minute:%Y-%m-%d %H:%M}"
