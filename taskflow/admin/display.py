"""How the console shows values: JSON blocks, status badges, times and ages, progress, links to filtered lists."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
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


def ago(when: datetime | None, now: datetime | None = None) -> SafeString | str:
    """A short relative time ("12 s ago", "in 3 minutes") with the exact time as its tooltip."""
    if when is None:
        return EMPTY
    return format_html('<time datetime="{}" title="{}">{}</time>', when.isoformat(), exact(when), relative(when, now))


def exact(when: datetime, *, ms: bool = False) -> str:
    """A time in the current time zone, to the second ("2026-11-24 00:27:48") or the millisecond."""
    text = timezone.localtime(when).strftime("%Y-%m-%d %H:%M:%S.%f" if ms else "%Y-%m-%d %H:%M:%S")
    return text[:-3] if ms else text


def timestamp(when: datetime | None, *, ms: bool = False, now: datetime | None = None) -> SafeString | str:
    """A time to the second (or millisecond) and how long ago it was: "2026-11-24 00:27:48 (3 s ago)"."""
    if when is None:
        return EMPTY
    return format_html(
        '<time datetime="{}">{}</time> <span class="tf-ago">({})</span>',
        when.isoformat(),
        exact(when, ms=ms),
        relative(when, now),
    )


def time_field(name: str, description: str) -> Callable[[Any, Any], SafeString | str]:
    """A ModelAdmin display method showing the model's datetime field `name` as `timestamp` does."""

    def shown(model_admin: Any, obj: Any) -> SafeString | str:
        return timestamp(getattr(obj, name))

    shown.short_description = description  # type: ignore[attr-defined]
    return shown


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.6g}"


def progress_bar(progress: dict[str, Any] | None, *, compact: bool = False) -> SafeString | str:
    """A task's progress (engine.progress.shown) as a bar with its percentage; the full form adds the counts,
    message and when it was reported."""
    if progress is None:
        return EMPTY
    done, total, percent = progress["done"], progress["total"], progress["percent"]
    counts = f"{_number(done)} of {_number(total)}"
    label = f"{percent:g} %" if percent is not None else counts
    bar = format_html(
        '<progress max="{}" value="{}" aria-label="{}">{}</progress> <span class="tf-progress-pct">{}</span>',
        total if total > 0 else 1,
        done if total > 0 else 0,
        label,
        label,
        label,
    )
    if compact:
        title = f"{counts}: {progress['message']}" if progress["message"] else counts
        return format_html('<span class="tf-progress" title="{}">{}</span>', title, bar)
    at = parse_datetime(progress["at"]) if progress.get("at") else None
    return format_html(
        '<div class="tf-progress tf-progress-full">{} <span class="tf-progress-counts">{}</span>'
        '{} <span class="tf-progress-at">{}</span></div>',
        bar,
        counts,
        format_html(' <span class="tf-progress-msg">{}</span>', progress["message"]) if progress["message"] else "",
        format_html("reported {}", relative(at)) if at else "",
    )


def tasks_url(**filters: Any) -> str:
    """The task list filtered by the console's query parameters (task_type, status, worker, ...)."""
    url = reverse("admin:taskflow_task_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def task_url(task_id: int) -> str:
    return reverse("admin:taskflow_task_change", args=[task_id])


def task_link(task_id: int, label: str | None = None) -> SafeString:
    return format_html('<a href="{}">{}</a>', task_url(task_id), label or str(task_id))
