"""Lifetimes of waiting and finished tasks: pending timeouts, success retention, purging.

Each duty selects ids in bounded batches (PURGE_BATCH) and then runs one statement by primary key
that repeats its condition, so a row that changed meanwhile is left alone and no statement holds
long locks; a short pause between batches lets workers' claims in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from ..conf import get_settings
from ..models import ScheduleCfg, Status, Task, TaskDependency
from . import dependencies, endings

log = logging.getLogger("taskflow.watch")

BATCH_PAUSE = 0.05  # seconds between bulk batches, so workers' claims get the table in between

KeepGoing = Callable[[], bool]


def _always() -> bool:
    return True


def fail_stale_pending(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Fail pending tasks that stayed due longer than their type's pending_timeout (paused types excepted)."""
    now = now or timezone.now()
    total = 0
    for cfg in ScheduleCfg.objects.filter(pending_timeout__gt=0, paused=False):
        cutoff = now - timedelta(seconds=cfg.pending_timeout)
        stale = Q(task_type=cfg.task_type, status=Status.PENDING, run_after__lt=cutoff)

        def fail(ids: list[int], stale: Q = stale, cfg: ScheduleCfg = cfg) -> int:
            count = Task.objects.filter(stale, id__in=ids).update(
                status=Status.FAILED,
                status_msg=f"pending timeout: not started within {cfg.pending_timeout}s of its due time",
                finished_at=now,
                updated_at=now,
            )
            # Their dependents follow (release ignores the ids that changed meanwhile and were not failed).
            dependencies.release_on_commit(ids)
            if count and endings.wanted(cfg.task_type):
                failed = Task.objects.filter(id__in=ids, status=Status.FAILED, finished_at=now)  # by this UPDATE
                endings.announce_finished((i, cfg.task_type) for i in failed.values_list("id", flat=True))
            return count

        count = _in_batches(stale, fail, keep_going)
        if count:
            log.info("failed %d %s task(s) pending past %ds", count, cfg.task_type, cfg.pending_timeout)
        total += count
    return total


def expire_successes(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Turn successes older than their type's success_retention into stopped tasks (0 keeps them)."""
    now = now or timezone.now()
    total = 0
    for cfg in ScheduleCfg.objects.filter(success_retention__gt=0):
        cutoff = now - timedelta(seconds=cfg.success_retention)
        old = Q(status=Status.SUCCESS, finished_at__lt=cutoff, task_type=cfg.task_type)
        count = _in_batches(
            old,
            lambda ids, old=old, cfg=cfg: Task.objects.filter(old, id__in=ids).update(
                status=Status.STOPPED, status_msg=f"success kept {cfg.success_retention}s, then stopped", updated_at=now
            ),
            keep_going,
        )
        if count:
            log.info("stopped %d %s success(es) older than %ds", count, cfg.task_type, cfg.success_retention)
        total += count
    return total


def purge_finished(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Delete failed and stopped tasks older than their type's purge_after_days, PURGE_BATCH rows at a time."""
    now = now or timezone.now()
    total = 0
    for cfg in ScheduleCfg.objects.filter(purge_after_days__gt=0):
        old = Q(
            task_type=cfg.task_type,
            status__in=[Status.FAILED, Status.STOPPED],
            # finished_at, not updated_at: it is indexed with status and never moves once set.
            finished_at__lt=now - timedelta(days=cfg.purge_after_days),
        )
        count = _in_batches(old, lambda ids, old=old: _delete(old, ids), keep_going)
        if count:
            log.info("purged %d %s task(s) finished over %d day(s) ago", count, cfg.task_type, cfg.purge_after_days)
        total += count
    return total


def _delete(which: Q, ids: list[int]) -> int:
    """Delete these tasks (if still `which`) and the dependency edges that made them wait."""
    deleted = Task.objects.filter(which, id__in=ids).delete()[0]
    # The edges these (finished) tasks waited by mean nothing once they are gone; the edges of tasks
    # that waited for them stay, so those still show what they depended on.
    TaskDependency.objects.filter(task_id__in=ids).exclude(task_id__in=Task.objects.filter(id__in=ids)).delete()
    return deleted


def _in_batches(which: Q, apply: Callable[[list[int]], int], keep_going: KeepGoing) -> int:
    """Apply a bulk change by primary key, PURGE_BATCH rows per statement, pausing in between."""
    batch = max(1, get_settings().PURGE_BATCH)
    total = 0
    while keep_going():
        # Selecting ids first keeps each write a short primary-key statement, and `apply` repeats
        # the condition so a row that changed meanwhile is left alone.
        ids = list(Task.objects.filter(which).values_list("id", flat=True)[:batch])
        if not ids:
            break
        done = apply(ids)
        total += done
        if len(ids) < batch or not done:
            break
        time.sleep(BATCH_PAUSE)
    return total
