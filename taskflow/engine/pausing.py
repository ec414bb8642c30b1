"""Pausing and resuming task types: workers stop claiming a paused type's tasks, and start again once resumed.

Workers re-read a type's config within CONFIG_REFRESH seconds, so a pause applies without a
restart; running attempts finish, and pending tasks of a paused type wait (expiry.py does not
time them out meanwhile). The console and the command line both call these; each change is one
guarded UPDATE (expecting the type's current state) and a TaskEvent about no task
(`task_id` NULL) naming the type, written in the same transaction.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction
from django.utils import timezone

from ..exceptions import InvalidTask
from ..models import ScheduleCfg, TaskEvent
from .operations import Actor, OperationResult, actor_name


def pause(task_types: Iterable[str], *, by: Actor, reason: str = "", dry_run: bool = False) -> OperationResult:
    """Pause these task types (each must be known: enqueued once, or configured); already paused ones are skipped."""
    return _set_paused("pause", task_types, True, by=by, reason=reason, dry_run=dry_run)


def resume(task_types: Iterable[str], *, by: Actor, reason: str = "", dry_run: bool = False) -> OperationResult:
    """Resume these paused task types; ones not paused are skipped."""
    return _set_paused("resume", task_types, False, by=by, reason=reason, dry_run=dry_run)


def _set_paused(
    action: str, task_types: Iterable[str], paused: bool, *, by: Actor, reason: str, dry_run: bool
) -> OperationResult:
    actor = actor_name(by)
    if not isinstance(reason, str):
        raise InvalidTask(f"reason must be text; got {reason!r}")
    names = list(dict.fromkeys([task_types] if isinstance(task_types, str) else task_types))
    result = OperationResult(action, dry_run=dry_run)
    with transaction.atomic():
        rows = ScheduleCfg.objects.filter(task_type__in=names)
        current = dict((rows if dry_run else rows.select_for_update()).values_list("task_type", "paused"))
        unknown = [name for name in names if name not in current]
        if unknown:
            raise InvalidTask(f"unknown task type: {', '.join(map(repr, unknown))}")
        changing = sorted(name for name, state in current.items() if state != paused)
        already = len(current) - len(changing)
        if already:
            result.skipped = {"already paused" if paused else "not paused": already}
        result.changed = len(changing)
        if dry_run or not changing:
            return result
        now = timezone.now()
        # Rows are locked above: the guard cannot miss, but states a rule the way every write here does.
        ScheduleCfg.objects.filter(task_type__in=changing, paused=not paused).update(paused=paused, updated_at=now)
        TaskEvent.objects.bulk_create(
            TaskEvent(
                task_id=None,
                at=now,
                actor=actor,
                action=action,
                reason=reason,
                changes={"task_type": name, "paused": [not paused, paused]},
            )
            for name in changing
        )
    return result
