"""Periodic tasks: schedules the taskwatch leader turns into one task per tick.

A schedule ticks at every match of its cron expression (five fields, read in its time zone by
cronsim) or at every multiple of `every` seconds since the Unix epoch. A tick's task has the key
"periodic:<name>" and the tick's Unix second as its version, so the identity rules make firing
idempotent: a second enqueue of the same tick returns the first task and an older tick is refused
(StaleVersion). The schedule's row records up to which second its ticks are settled, changed in the
same transaction as the enqueue (under the row's lock), so a tick is fired once even after its task
failed, when a second enqueue of the identity would run it again.

When several ticks are due (downtime, a hand-over, a slow pass), `catch_up` decides: 0 fires only
the latest (a newer tick's task also supersedes an older one still waiting: the newest version
wins); N fires the latest N one after another, each once the previous tick's task has finished, so
they never overlap nor supersede each other. "Run now" enqueues under a key of its own,
"periodic:<name>:manual", so it never takes a tick's identity.

Declarations (TASKFLOW["PERIODIC"] and `taskflow.periodic(...)`) and console edits: the last change
wins. `sync_schedules` applies a declaration when it first appears and whenever it changes (every
declared field, `enabled` included); in between, console edits of the row stand. See docs/periodic.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import QuerySet

from ..conf import get_settings
from ..exceptions import InvalidSchedule, InvalidTask, StaleVersion
from ..models import PeriodicTask, Status, Task
from .enqueueing import enqueue
from .validation import json_text, validate_priority, validate_task_type

log = logging.getLogger("taskflow.periodic")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
KEY_PREFIX = "periodic:"
MANUAL_SUFFIX = ":manual"
# The fields a declaration sets; the rest of a row (when ticks are settled, the last run) is the engine's.
DECLARED_FIELDS = ("task_type", "cron", "every", "timezone", "payload", "priority", "catch_up", "enabled")
# What a schedule's tasks are: whoever sets these decides what tasks get made, so doing it (or
# creating a schedule) needs the right to create tasks, taskflow.add_task (docs/periodic.md).
TASK_FIELDS = ("task_type", "payload")
# Changing one of these changes when the schedule ticks: ticks already past are then settled, not fired.
TIMING_FIELDS = ("cron", "every", "timezone")
MAX_EVERY = 366 * 86400
MAX_CATCH_UP = 1000
SOURCES = ("settings", "code", "console")


class Schedule(Protocol):
    """What the tick arithmetic reads: a PeriodicTask row or a Declaration."""

    cron: str
    every: int | None
    timezone: str


@dataclass(frozen=True)
class Declaration:
    """A schedule declared in TASKFLOW["PERIODIC"] or in code, validated."""

    name: str
    task_type: str
    cron: str = ""
    every: int | None = None
    timezone: str = "UTC"
    payload: Any = field(default_factory=dict)
    priority: int = 0
    catch_up: int = 0
    enabled: bool = True
    source: str = "settings"

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DECLARED_FIELDS}

    def digest(self) -> str:
        """Fingerprint of the declared fields: a row whose stored digest differs follows this declaration."""
        text = json.dumps({**self.fields(), "source": self.source}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Validation


def schedule_errors(schedule: Any, *, settings_known: bool = True) -> dict[str, str]:
    """What is wrong with a schedule (a row or a Declaration), as {field: message}; empty if nothing.

    `settings_known` False is for checking the TASKFLOW setting itself: the payload is then checked
    as JSON but not against MAX_PAYLOAD_BYTES, which is being read from the same setting.
    """
    errors: dict[str, str] = {}
    name = getattr(schedule, "name", None)
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        errors["name"] = (
            f"A schedule name is 1-100 letters, digits, '_', '.' or '-', starting with a letter or digit; got {name!r}."
        )
    try:
        validate_task_type(schedule.task_type)
    except InvalidTask as exc:
        errors["task_type"] = str(exc)
    cron, every = schedule.cron or "", schedule.every
    if bool(cron) == (every is not None):
        if cron:
            errors["cron"] = 'Give either a cron expression or "every" (seconds), not both.'
        else:
            errors["every"] = 'Give a cron expression or "every" (seconds).'

    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_EVERY):
        errors["every"] = f"every must be a whole number of seconds from 1 to {MAX_EVERY}; got {every!r}."
    zone = _zone_or_none(schedule.timezone)
    if zone is None:
        errors["timezone"] = f"Unknown time zone {schedule.timezone!r} (use an IANA name such as 'Europe/Paris')."
    if cron and "cron" not in errors:
        if not isinstance(cron, str):
            errors["cron"] = f"A cron expression is a string; got {cron!r}."
        else:
            try:
                CronSim(cron, datetime.now(zone or UTC))
            except CronSimError as exc:
                errors["cron"] = (
                    f"Not a valid cron expression ({exc}): {cron!r}. Five fields: minute hour day month weekday."
                )
    try:
        validate_priority(schedule.priority)
    except InvalidTask as exc:
        errors["priority"] = str(exc)
    catch_up = schedule.catch_up
    if isinstance(catch_up, bool) or not isinstance(catch_up, int) or not 0 <= catch_up <= MAX_CATCH_UP:
        errors["catch_up"] = f"catch_up must be a whole number from 0 to {MAX_CATCH_UP}; got {catch_up!r}."
    try:
        if settings_known:
            json_text("payload", schedule.payload)
        else:
            json.dumps(schedule.payload, allow_nan=False)
    except InvalidTask as exc:
        errors["payload"] = str(exc)
    except (TypeError, ValueError, RecursionError) as exc:
        errors["payload"] = f"payload must be JSON-serialisable: {exc}"
    if not isinstance(schedule.enabled, bool):
        errors["enabled"] = f"enabled must be True or False; got {schedule.enabled!r}."
    return errors


def _zone_or_none(name: object) -> ZoneInfo | None:
    if not isinstance(name, str) or not name:
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return None


def declaration(name: object, spec: object, source: str = "settings", *, settings_known: bool = True) -> Declaration:
    """A declaration from its name and options; InvalidSchedule names the first thing wrong."""
    if not isinstance(spec, Mapping):
        raise InvalidSchedule(f"schedule {name!r} must be a dict of options; got {type(spec).__name__}")
    unknown = set(spec) - set(DECLARED_FIELDS)
    if unknown:
        raise InvalidSchedule(f"schedule {name!r} has unknown option(s): {', '.join(sorted(map(str, unknown)))}")
    if "task_type" not in spec:
        raise InvalidSchedule(f"schedule {name!r} needs a task_type", "task_type")
    options = {k: v for k, v in spec.items() if k != "payload"}
    options["cron"] = options.get("cron") or ""
    decl = Declaration(
        name=name,  # type: ignore[arg-type]  (checked just below)
        payload={} if spec.get("payload") is None else spec["payload"],
        source=source,
        **options,
    )
    errors = schedule_errors(decl, settings_known=settings_known)
    if errors:
        culprit, message = next(iter(errors.items()))
        raise InvalidSchedule(f"schedule {name!r}: {message.rstrip('.')}", culprit)
    return decl


def declaration_problems(value: Mapping[Any, Any]) -> list[str]:
    """Everything wrong with a TASKFLOW["PERIODIC"] value (for the settings checks)."""
    problems = []
    for name, spec in value.items():
        try:
            declaration(name, spec, settings_known=False)
        except InvalidSchedule as exc:
            problems.append(str(exc))
        else:
            if name in _code_declarations:
                problems.append(f"schedule {name!r} is declared both here and in code ({_code_declarations[name]!r})")
    return problems


_code_declarations: dict[str, Declaration] = {}


def periodic(
    name: str,
    *,
    task_type: str,
    cron: str = "",
    every: int | None = None,
    payload: Any = None,
    priority: int = 0,
    timezone: str = "UTC",
    catch_up: int = 0,
    enabled: bool = True,
) -> Declaration:
    """Declare a schedule in code (e.g. in an app's tasks.py); the taskwatch leader syncs it to a row."""
    spec = {
        "task_type": task_type,
        "cron": cron,
        "every": every,
        "payload": payload,
        "priority": priority,
        "timezone": timezone,
        "catch_up": catch_up,
        "enabled": enabled,
    }
    decl = declaration(name, spec, source="code")
    if name in get_settings().PERIODIC:
        raise InvalidSchedule(f"schedule {name!r} is already declared in TASKFLOW['PERIODIC']")
    existing = _code_declarations.get(name)
    if existing is not None and existing != decl:
        raise InvalidSchedule(f"schedule {name!r} is already declared in code, differently: {existing!r}")
    _code_declarations[name] = decl
    return decl


def declarations() -> dict[str, Declaration]:
    """Every declared schedule: TASKFLOW["PERIODIC"] (checked at startup) and those declared in code."""
    found = {name: declaration(name, spec) for name, spec in get_settings().PERIODIC.items()}
    for name, decl in _code_declarations.items():
        if name in found:
            raise InvalidSchedule(f"schedule {name!r} is declared both in TASKFLOW['PERIODIC'] and in code")
        found[name] = decl
    return found


# ---------------------------------------------------------------------------------------------
# Ticks


def ticks_through(schedule: Schedule, now: int, after: int, limit: int) -> list[int]:
    """The ticks t with `after` < t <= `now` (Unix seconds), newest first, at most `limit` of them."""
    ticks: list[int] = []
    if schedule.every:
        tick = now - now % schedule.every
        while tick > after and len(ticks) < limit:
            ticks.append(tick)
            tick -= schedule.every
        return ticks
    zone = ZoneInfo(schedule.timezone)
    # cronsim's start is exclusive: start one second later so a tick at `now` itself counts.
    for moment in CronSim(schedule.cron, datetime.fromtimestamp(now + 1, zone), reverse=True):
        tick = int(moment.timestamp())
        if tick <= after or len(ticks) >= limit:
            break
        ticks.append(tick)
    return ticks


def next_tick(schedule: Schedule, after: int) -> int | None:
    """The first tick strictly after `after` (Unix seconds); None if the cron never matches again."""
    if schedule.every:
        return after - after % schedule.every + schedule.every
    moment = next(iter(CronSim(schedule.cron, datetime.fromtimestamp(after, ZoneInfo(schedule.timezone)))), None)
    return None if moment is None else int(moment.timestamp())


def describe(schedule: Schedule) -> str:
    """The schedule as people read it: "every 30 s" or "*/5 * * * * (Europe/Paris)"."""
    if schedule.every:
        return f"every {schedule.every} s"
    return f"{schedule.cron} ({schedule.timezone})"


def schedule_key(name: str) -> str:
    """The key of a schedule's tick tasks (their version is the tick)."""
    return f"{KEY_PREFIX}{name}"


def manual_key(name: str) -> str:
    """The key of a schedule's "run now" tasks (their version is the second of the click)."""
    return f"{KEY_PREFIX}{name}{MANUAL_SUFFIX}"


def schedule_of(task: Task) -> PeriodicTask | None:
    """The schedule a task was fired by (a tick or "run now"), if it still exists."""
    if not task.key or not task.key.startswith(KEY_PREFIX):
        return None
    name = task.key.removeprefix(KEY_PREFIX).removesuffix(MANUAL_SUFFIX)
    return PeriodicTask.objects.filter(pk=name, task_type=task.task_type).first()


def _unix(moment: datetime | int | None) -> int:
    if moment is None:
        return int(time.time())
    if isinstance(moment, int):
        return moment
    return int(moment.timestamp())


def _moment(unix: int | None) -> datetime | None:
    return None if unix is None else datetime.fromtimestamp(unix, UTC)


# ---------------------------------------------------------------------------------------------
# Rows: declarations synced in, console edits


def sync_schedules(now: datetime | int | None = None) -> int:
    """Make the rows follow the declarations; returns how many rows were created, updated or deleted.

    A row is written only when its declaration is new or changed since it was last applied, so a
    console edit stands until the declaration itself changes. A declared row whose declaration is
    gone is deleted (its tasks stay); rows made in the console are never touched.
    """
    now_s = _unix(now)
    wanted = declarations()
    rows = {row.name: row for row in PeriodicTask.objects.only("name", "source", "declared_hash")}
    changed = 0
    for name, decl in wanted.items():
        row = rows.get(name)
        digest = decl.digest()
        if row is None:
            changed += _create(decl, digest, now_s)
        elif row.declared_hash != digest:
            changed += _edit(name, {**decl.fields(), "source": decl.source, "declared_hash": digest}, now_s)
    gone = [name for name, row in rows.items() if row.source != "console" and name not in wanted]
    if gone:
        deleted, _ = PeriodicTask.objects.filter(name__in=gone).exclude(source="console").delete()
        if deleted:
            log.info("periodic schedules no longer declared, deleted: %s", ", ".join(sorted(gone)))
        changed += deleted
    return changed


def _create(decl: Declaration, digest: str, now_s: int) -> int:
    row = PeriodicTask(name=decl.name, source=decl.source, declared_hash=digest, **decl.fields())
    try:
        with transaction.atomic():
            create_schedule(row, now=now_s)
    except IntegrityError:  # another process synced it first
        return 0
    log.info("periodic schedule %s declared in %s: %s", decl.name, decl.source, describe(decl))
    return 1


def create_schedule(row: PeriodicTask, *, now: datetime | int | None = None) -> PeriodicTask:
    """Insert a new schedule row; its first tick is the first one after now. InvalidSchedule if malformed."""
    _refuse_errors(row)
    now_s = _unix(now)
    row.settled_until = now_s
    row.next_run_at = _moment(next_tick(row, now_s)) if row.enabled else None
    row.save(force_insert=True)
    return row


def edit_schedule(name: str, changes: Mapping[str, Any], *, now: datetime | int | None = None) -> bool:
    """Apply an edit of a schedule's declared fields; returns whether the row exists. InvalidSchedule if malformed.

    Ticks already past are settled without firing when the timing changes or the schedule is
    enabled again: neither edit may fire a burst of "missed" ticks.
    """
    allowed = set(DECLARED_FIELDS)
    unknown = set(changes) - allowed
    if unknown:
        raise InvalidSchedule(f"not an editable field: {', '.join(sorted(unknown))}")
    return bool(_edit(name, changes, _unix(now)))


def _edit(name: str, changes: Mapping[str, Any], now_s: int) -> int:
    # Under the row's lock: the leader fires under the same lock, so an edit and a firing never interleave.
    with transaction.atomic():
        row = PeriodicTask.objects.select_for_update().filter(pk=name).first()
        if row is None:
            return 0
        was_enabled = row.enabled
        timing = tuple(getattr(row, f) for f in TIMING_FIELDS)
        for attr, value in changes.items():
            setattr(row, attr, value)
        _refuse_errors(row)
        if tuple(getattr(row, f) for f in TIMING_FIELDS) != timing or (row.enabled and not was_enabled):
            row.settled_until = max(row.settled_until, now_s)
        row.next_run_at = _moment(next_tick(row, row.settled_until)) if row.enabled else None
        row.save(update_fields=[*changes, "settled_until", "next_run_at", "updated_at"])
    return 1


def _refuse_errors(row: PeriodicTask) -> None:
    errors = schedule_errors(row)
    if errors:
        culprit, message = next(iter(errors.items()))
        raise InvalidSchedule(f"schedule {row.name!r}: {message.rstrip('.')}", culprit)


def set_enabled(names: Iterable[str], enabled: bool, *, now: datetime | int | None = None) -> list[str]:
    """Enable or disable schedules; returns the names that changed."""
    now_s = _unix(now)
    changing = PeriodicTask.objects.filter(pk__in=list(names)).exclude(enabled=enabled).values_list("pk", flat=True)
    return [name for name in list(changing) if _edit(name, {"enabled": enabled}, now_s)]


def run_now(name: str, *, now: datetime | int | None = None) -> Task:
    """Enqueue one extra run of a schedule now, whether or not it is enabled; its ticks are unchanged.

    The task's key is "periodic:<name>:manual" and its version the current second, so a form
    submitted twice in a second makes one task (`enqueue_outcome` "existing" the second time).
    """
    row = PeriodicTask.objects.get(pk=name)
    return enqueue(row.task_type, row.payload, key=manual_key(name), version=_unix(now), priority=row.priority)


def due_schedules(now: datetime | int | None = None) -> QuerySet[PeriodicTask]:
    """Enabled schedules whose next tick has come."""
    return PeriodicTask.objects.filter(enabled=True, next_run_at__lte=_moment(_unix(now))).order_by("next_run_at")


# ---------------------------------------------------------------------------------------------
# Firing


def fire_schedule(name: str, now: datetime | int | None = None) -> list[Task]:
    """Fire the schedule's next tick if it is due; returns the task (or nothing).

    `catch_up` 0: the latest due tick fires and any older due ones are skipped; its task supersedes
    a previous tick's task still waiting (the identity rules: the newest version wins).
    `catch_up` N: the ticks run one after another. While the previous tick's task is unfinished
    nothing fires; then the oldest of the latest N due ticks fires (older ones are skipped) and
    the newer ones stay due for the next passes.
    """
    now_s = _unix(now)
    with transaction.atomic():
        row = PeriodicTask.objects.select_for_update().filter(pk=name, enabled=True).first()
        if row is None or row.next_run_at is None or _unix(row.next_run_at) > now_s:
            return []
        if row.catch_up and _unfinished(row.last_task_id):
            return []
        keep = max(1, row.catch_up)
        due = ticks_through(row, now_s, row.settled_until, keep + 1)  # newest first
        tick = due[:keep][-1] if due else None
        settled = tick if row.catch_up and tick is not None else now_s
        task = None
        if tick is not None:
            try:
                task = enqueue(
                    row.task_type,
                    row.payload,
                    key=schedule_key(name),
                    version=tick,
                    priority=row.priority,
                    run_after=_moment(tick),
                )
            except StaleVersion as exc:  # a newer tick already has a task: this one is refused
                log.warning("periodic %s: tick %d refused (%s)", name, tick, exc)
        changes: dict[str, Any] = {"settled_until": settled, "next_run_at": _moment(next_tick(row, settled))}
        if task is not None:
            changes.update(last_run_at=_moment(tick), last_task_id=task.pk)
        # Guarded by the settled second read under the lock: the row moves forward exactly once per firing.
        PeriodicTask.objects.filter(pk=name, enabled=True, settled_until=row.settled_until).update(**changes)
    if task is None:
        return []
    log.info(
        "periodic %s: fired tick %d as task %s (%s)%s",
        name,
        tick,
        task.pk,
        task.enqueue_outcome,
        f"; {len(due) - keep}+ older due tick(s) skipped (catch_up {row.catch_up})" if len(due) > keep else "",
    )
    return [task]


def _unfinished(task_id: int | None) -> bool:
    """Whether a tick's task is still to finish (any status but success, failed or stopped)."""
    if task_id is None:
        return False
    finished = (Status.SUCCESS, Status.FAILED, Status.STOPPED)
    return Task.objects.filter(pk=task_id).exclude(status__in=finished).exists()


def fire_periodic_tasks(now: datetime | None = None, keep_going: Callable[[], bool] = lambda: True) -> int:
    """The taskwatch duty: sync the declarations, then fire every due schedule; returns how many tasks it fired."""
    now_s = _unix(now)
    try:
        sync_schedules(now_s)
    except InvalidSchedule as exc:  # a declaration in code clashing with the settings: the rows still fire
        log.error("periodic schedules not synced: %s", exc)
    fired = 0
    for name in list(due_schedules(now_s).values_list("name", flat=True)):
        if not keep_going():
            break
        try:
            fired += len(fire_schedule(name, now_s))
        except DatabaseError:
            raise  # the watcher reconnects and tries the whole duty again next pass
        except Exception:
            # One broken row (say, a time zone this host's tz database lacks) must not stop the others.
            log.exception("periodic %s could not fire; trying again next pass", name)
    return fired
