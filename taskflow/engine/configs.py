"""Per-type schedule configuration, created on first use and cached briefly so live edits apply."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from django.db import IntegrityError, transaction

from ..conf import get_settings
from ..models import ScheduleCfg


class ConfigCache:
    """ScheduleCfg rows by task type, re-read at most every CONFIG_REFRESH seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[float, ScheduleCfg | None]] = {}  # None: no row (create=False)

    def get(self, task_type: str) -> ScheduleCfg:
        return self.get_many([task_type])[task_type]

    def get_many(self, task_types: Iterable[str], *, create: bool = True) -> dict[str, ScheduleCfg]:
        """The config of each type, created on first use; with `create=False`, types without one are left out.

        A caller that may name any type (a remote worker's hold) passes `create=False`: every type
        that was ever enqueued has its row (enqueue creates it), so nothing due is missed, and
        naming unknown types creates nothing. A missing row is remembered for CONFIG_REFRESH too.
        """
        now = time.monotonic()
        ttl = get_settings().CONFIG_REFRESH
        wanted = list(dict.fromkeys(task_types))
        with self._lock:
            stale = [
                t
                for t in wanted
                if t not in self._rows or now - self._rows[t][0] > ttl or (create and self._rows[t][1] is None)
            ]
        if stale:
            found: dict[str, ScheduleCfg | None] = {
                c.task_type: c for c in ScheduleCfg.objects.filter(task_type__in=stale)
            }
            for task_type in stale:
                if task_type not in found:
                    found[task_type] = _create(task_type) if create else None
            with self._lock:
                for task_type, cfg in found.items():
                    self._rows[task_type] = (now, cfg)
        with self._lock:
            rows = {t: self._rows[t][1] for t in wanted}
        return {t: cfg for t, cfg in rows.items() if cfg is not None}

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()


def _create(task_type: str) -> ScheduleCfg:
    cfg = ScheduleCfg.from_settings(task_type)
    try:
        with transaction.atomic():
            cfg.save(force_insert=True)
    except IntegrityError:  # another process created it first
        cfg = ScheduleCfg.objects.get(task_type=task_type)
    return cfg


configs = ConfigCache()
