"""How the console shows values: JSON blocks, status badges, ages and links to filtered lists."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

EMPTY = "-"


def pretty_json(value: Any) -> str:
    """A JSON value as an indented, wrapped block."""
    if value in (None, "", {}, []):
        return EMPTY
    return format_html('<pre class="tf-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


def text_block(text: str) -> str:
    """Multi-line text (a status message with its traceback) as a wrapped block."""
    return format_html('<pre class="tf-text">{}</pre>', text) if text else EMPTY


def status_badge(status: str) -> SafeString:
    """A task status as a coloured badge (colours in static/taskflow/console.css)."""
    return format_html('<span class="tf-badge tf-{}">{}</span>', status, status)


def _span(seconds: float, when: datetime, now: datetime) -> str:
    """A duration as people say it: "12 s" under a minute, else the largest unit ("3 minutes")."""
    if seconds < 60:
        return f"{int(seconds)} s"
    return timesince(min(when, now), max(when, now), depth=1)


def age(when: datetime | None, now: datetime | None = None) -> str:
    """How long ago `when` was ("12 s", "3 minutes"), or "-"."""
    if when is None:
        return EMPTY
    now = now or timezone.now()
    return _span((now - when).total_seconds(), when, now)


def relative(when: datetime | None, now: datetime | None = None) -> str:
    """A past or future time relative to now: "in 5 minutes", "2 hours ago", or "now"."""
    if when is None:
        return EMPTY
    now = now or timezone.now()
    seconds = (when - now).total_seconds()
    if abs(seconds) < 1:
        return "now"
    span = _span(abs(seconds), when, now)
    return f"in {span}" if seconds > 0 else f"{span} ago"


def tasks_url(**filters: Any) -> str:
    """The task list filtered by the console's query parameters (task_type, status, worker, ...)."""
    url = reverse("admin:taskflow_task_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def task_url(task_id: int) -> str:
    return reverse("admin:taskflow_task_change", args=[task_id])


def task_link(task_id: int, label: str | None = None) -> SafeString:
    return format_html('<a href="{}">{}</a>', task_url(task_id), label or str(task_id))
