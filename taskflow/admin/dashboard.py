"""The dashboard (/admin/taskflow/dashboard/): totals across types and the fleet, then per task type the rollup's
numbers and charts.

Everything shown comes from `engine.stats.current()`, which reads the small rollup taskwatch
refreshes every pass, and from the workers' liveness rows, so the page costs the same at any
number of tasks. Every number links to
the task list filtered to the tasks it counts (the list's own query parameters).
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone

from ..conf import get_settings
from ..engine import stats, workers
from ..models import Status, Task
from . import charts, display
from .live import live

VIEW_PERMISSION = "taskflow.view_task"
WINDOW_S = 3600
RECENT_MINUTES = 5  # the totals' "last minutes": throughput and failures
URL_NAME = "taskflow_dashboard"


def dashboard_view(request: HttpRequest, site: admin.AdminSite = admin.site) -> TemplateResponse:
    """The dashboard page; staff only (admin_view), and `view_task` to see tasks' numbers."""
    if not request.user.has_perm(VIEW_PERMISSION):
        raise PermissionDenied
    data = stats.current(WINDOW_S)
    list_url = display.tasks_url()
    generated = datetime.fromisoformat(data["generated_at"])
    # Refreshed every pass: older than a few passes means no taskwatch leads.
    stale_after = max(60.0, 3 * get_settings().WATCH_INTERVAL)
    age = (timezone.now() - generated).total_seconds()
    context = {
        **site.each_context(request),
        "title": "Dashboard",
        "opts": Task._meta,
        "totals": _totals(data["types"], list_url),
        "cards": [_card(task_type, numbers, list_url) for task_type, numbers in data["types"].items()],
        "generated": generated,
        "stale": age > stale_after,
        "refreshed_ago": display.age(generated),
        "window_minutes": WINDOW_S // 60,
        "tasks_url": list_url,
        **live("#content-main"),
    }
    return TemplateResponse(request, "taskflow/dashboard.html", context)


def _totals(types: dict[str, dict[str, Any]], list_url: str) -> dict[str, Any]:
    """The top of the page: counts by status across types, the fleet, throughput and failures of the last minutes."""
    counts: Counter[str] = Counter()
    by_minute: dict[str, dict[str, Any]] = {}
    for n in types.values():
        counts.update(n["counts"])
        for m in n["per_minute"]:
            into = by_minute.setdefault(m["minute"], {"minute": m["minute"], "completed": 0, "failed": 0})
            into["completed"] += m["completed"]
            into["failed"] += m["failed"]
    minutes = [by_minute[k] for k in sorted(by_minute)]
    recent = minutes[-RECENT_MINUTES:]
    since = datetime.fromisoformat(recent[0]["minute"]) if recent else timezone.now()
    hour_since = datetime.fromisoformat(minutes[0]["minute"]) if minutes else timezone.now()
    completed, failed = sum(m["completed"] for m in recent), sum(m["failed"] for m in recent)
    hour_completed, hour_failed = sum(m["completed"] for m in minutes), sum(m["failed"] for m in minutes)
    ages = [n["oldest_pending_age_s"] for n in types.values() if n["oldest_pending_age_s"] is not None]
    oldest = max(ages, default=None)
    fleet = workers.alive()
    hosts = Counter(w["host"] for w in fleet)
    workers_url = reverse("admin:taskflow_workerprocess_changelist")
    links = _Links(list_url)
    judged = hour_completed + hour_failed
    return {
        "counts": [(status, counts.get(status, 0), links.tasks(status__exact=status)) for status in Status.values],
        "in_flight": sum(n["in_flight"] for n in types.values()),
        "in_flight_url": links.tasks(status__exact=Status.PROCESSING),
        "capacity": sum(w["concurrency"] for w in fleet),
        "workers": len(fleet),
        "workers_url": f"{workers_url}?alive=yes",
        "hosts": [
            (host, count, f"{workers_url}?{urlencode({'alive': 'yes', 'host': host})}")
            for host, count in sorted(hosts.items())
        ],
        "oldest_pending": _wait(oldest),
        "pending_url": links.tasks(status__exact=Status.PENDING),
        "recent_minutes": len(recent),
        "completed": completed,
        "completed_url": links.finished(Status.SUCCESS, since),
        "per_minute": f"{completed / max(1, len(recent)):.1f}",
        "failed": failed,
        "failed_url": links.finished(Status.FAILED, since),
        "hour_completed": hour_completed,
        "hour_completed_url": links.finished(Status.SUCCESS, hour_since),
        "hour_failed": hour_failed,
        "hour_failed_url": links.finished(Status.FAILED, hour_since),
        "success_rate": f"{hour_completed / judged * 100:.1f} %" if judged else None,
        "chart": charts.minute_bars(
            minutes, label=_minute_label, link=links.minute, title="All types: tasks finished per minute"
        ),
    }


class _Links:
    """Links to the task list filtered to what a number counts (optionally within one type)."""

    def __init__(self, list_url: str, task_type: str | None = None) -> None:
        self.list_url, self.task_type = list_url, task_type

    def tasks(self, **filters: str) -> str:
        # One reverse() per page, not one per link: a page has hundreds (a bar per minute and type).
        if self.task_type is not None:
            filters = {"task_type": self.task_type, **filters}
        return f"{self.list_url}?{urlencode(filters)}" if filters else self.list_url

    def finished(self, status: str | None, start: datetime, end: datetime | None = None) -> str:
        filters = {"finished_from": _local(start)}
        if end is not None:
            filters["finished_to"] = _local(end)
        if status:
            filters["status__exact"] = status
        return self.tasks(**filters)

    def minute(self, m: dict[str, Any], status: str) -> str:
        """The tasks that finished with `status` in minute `m` (a chart's bar)."""
        start = datetime.fromisoformat(m["minute"])
        return self.finished(status, start, start + timedelta(seconds=59, microseconds=999_999))


def _minute_label(m: dict[str, Any]) -> str:
    return timezone.localtime(datetime.fromisoformat(m["minute"])).strftime("%H:%M")


def _wait(seconds: float | None) -> str | None:
    return display.age(timezone.now() - timedelta(seconds=seconds)) if seconds is not None else None


def _local(when: datetime) -> str:
    """A time as the list's time filters read it (the current time zone, to the microsecond)."""
    return timezone.localtime(when).strftime("%Y-%m-%dT%H:%M:%S.%f")


def _card(task_type: str, n: dict[str, Any], list_url: str) -> dict[str, Any]:
    """What one type's panel shows: each number with the list of the tasks behind it."""
    minutes = n["per_minute"]
    since = datetime.fromisoformat(minutes[0]["minute"]) if minutes else timezone.now()
    links = _Links(list_url, task_type)
    tasks = links.tasks
    completed = sum(m["completed"] for m in minutes)
    failed = sum(m["failed"] for m in minutes)
    rate = n["success_rate"]
    oldest = n["oldest_pending_age_s"]
    return {
        "task_type": task_type,
        "config_url": reverse("admin:taskflow_schedulecfg_change", args=[quote(task_type)]),
        "paused": n["paused"],
        "counts": [(status, count, tasks(status__exact=status)) for status, count in n["counts"].items()],
        "in_flight": n["in_flight"],
        "in_flight_url": tasks(status__exact=Status.PROCESSING),
        "limit": n["limit"],
        "oldest_pending": _wait(oldest),
        "oldest_pending_s": oldest,
        "pending_url": tasks(status__exact=Status.PENDING),
        "completed": completed,
        "completed_url": links.finished(Status.SUCCESS, since),
        "failed": failed,
        "failed_url": links.finished(Status.FAILED, since),
        "success_rate": None if rate is None else f"{rate * 100:.1f} %",
        "finished_url": links.finished(None, since),
        "p50": _ms(n["run_time_ms"]["p50"]),
        "p95": _ms(n["run_time_ms"]["p95"]),
        "chart": charts.minute_bars(
            minutes, label=_minute_label, link=links.minute, title=f"{task_type}: tasks finished per minute"
        ),
    }


def _ms(value: float | None) -> str | None:
    if value is None:
        return None
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def install(site: admin.AdminSite) -> None:
    """Add the dashboard to `site`: its URL, and an entry in taskflow's part of the index and sidebar."""
    site_urls = site.get_urls
    site_app_list = site.get_app_list

    def get_urls() -> list[URLPattern]:
        # Before the site's own patterns; "taskflow/dashboard/" matches none of them anyway.
        view = site.admin_view(partial(dashboard_view, site=site))
        return [path("taskflow/dashboard/", view, name=URL_NAME), *site_urls()]

    def get_app_list(request: HttpRequest, app_label: str | None = None) -> list[dict[str, Any]]:
        apps = site_app_list(request, app_label)
        if request.user.has_perm(VIEW_PERMISSION):
            for app in apps:
                if app["app_label"] == "taskflow":
                    entry = {
                        "name": "Dashboard",
                        "object_name": "Dashboard",
                        "admin_url": reverse(f"{site.name}:{URL_NAME}", current_app=site.name),
                        "add_url": None,
                        "view_only": True,
                        "perms": {"view": True},
                    }
                    app["models"].insert(0, entry)
        return apps

    site.get_urls = get_urls  # type: ignore[method-assign]
    site.get_app_list = get_app_list  # type: ignore[method-assign]
