"""The task list and the task page.

Task rows are read-only here: every change goes through the engine's operations (actions.py),
never through a model form that could overwrite a worker's concurrent report.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString

from ..engine import filtering, payload_search, rolling
from ..engine import progress as progress_rules
from ..engine.configs import configs
from ..engine.dependencies import neighbours
from ..engine.operations import applicable
from ..engine.operations import revivals as revivals_of
from ..engine.periodic import MANUAL_SUFFIX, schedule_of
from ..engine.validation import MAX_BIGINT
from ..models import Status, Task, TaskEvent
from . import display
from .actions import OPERATE_PERMISSION, OPERATIONS, list_actions, operate_view
from .filters import (
    CreatedRangeFilter,
    FinishedRangeFilter,
    PriorityRangeFilter,
    StageFilter,
    TaskTypeFilter,
    WorkerFilter,
)
from .history import history_view
from .listing import CappedChangeList, ReadOnlyAdmin
from .live import live

# What the list reads of each row: never the JSON columns, which may hold a megabyte each.
# (progress is JSON too, but small: two numbers and a message of at most 200 characters.)
LIST_COLUMNS = (
    "id",
    "task_type",
    "key",
    "version",
    "status",
    "stage",
    "priority",
    "attempts",
    "run_after",
    "worker_id",
    "created_at",
    "progress",
    "lease_token",
)
OTHER_VERSIONS_SHOWN = 20
EVENTS_SHOWN = 50
NEIGHBOURS_SHOWN = 50  # dependencies and dependents, each


class TaskChangeList(CappedChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Task]:
        return super().get_queryset(request, exclude_parameters).only(*LIST_COLUMNS)


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    # Few columns, each of short lines, so the list fits a 1,400 px window beside both sidebars:
    # the task (type, key@version, stage), its state (status, progress, worker), and its times.
    list_display = ["id", "task", "state", "priority", "attempts", "when"]
    list_filter = [
        "status",
        TaskTypeFilter,
        StageFilter,
        PriorityRangeFilter,
        CreatedRangeFilter,
        FinishedRangeFilter,
        WorkerFilter,
    ]
    search_fields = ["id"]  # shows the search box; get_search_results does the searching
    search_help_text = (
        f"Exact task id, key, trace id or user id; or a payload value, payload.order_id = 42, among the "
        f"newest {payload_search.SCAN_LIMIT:,} tasks matching the filters."
    )
    ordering = ["-id"]
    sortable_by = ["id"]  # ids are time-ordered; any other order would sort the whole match
    actions = list_actions()
    change_form_template = "admin/taskflow/task/change_form.html"
    # Several short fields to a line; the task page's own template puts the attempts, the other
    # versions and the history between these and the (possibly large) JSON data.
    fieldsets = [
        (
            None,
            {
                "fields": [
                    ("id", "task_type", "status_badge"),
                    "progress_block",
                    ("key", "version", "superseded_by"),
                    ("stage", "priority", "attempts", "max_retries_shown", "timeout_shown"),
                    ("trace_id", "user_id"),
                    "status_msg_block",
                ]
            },
        ),
        (
            "Schedule and lease",
            {
                "fields": [
                    ("run_after_at", "order_time_at", "prefer_host", "prefer_host_until_at"),
                    ("worker_id", "lease_token", "lease_expires_at_at", "heartbeat_at_at"),
                    ("created_at_at", "started_at_at", "finished_at_at", "updated_at_at"),
                ]
            },
        ),
        ("Data", {"fields": ["payload_block", "context_block", "checkpoint_block", "result_block"]}),
    ]
    readonly_fields = [
        name
        for _, options in fieldsets
        for line in options["fields"]
        for name in (line if isinstance(line, tuple) else (line,))
    ]

    class Media:
        css = {"all": ["taskflow/console.css"]}

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.{OPERATE_PERMISSION}")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return TaskChangeList

    def get_urls(self) -> list[URLPattern]:
        operate = path(
            "operate/<str:action>/",
            self.admin_site.admin_view(self.operate_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_operate",
        )
        history = path(
            "history/",
            self.admin_site.admin_view(self.history_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_history",
        )
        return [operate, history, *super().get_urls()]

    def operate_view(self, request: HttpRequest, action: str) -> HttpResponse:
        return operate_view(self, request, action)

    def history_view(self, request: HttpRequest) -> HttpResponse:
        return history_view(self, request)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Task | None:
        """The task page's task, from the task table or, once rolled, from its history table (read-only)."""
        task = super().get_object(request, object_id, from_field)
        if task is None and from_field is None and object_id.isdigit() and int(object_id) <= MAX_BIGINT:
            try:
                task = rolling.get_task(int(object_id))
            except Task.DoesNotExist:
                return None
        return task

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Task], search_term: str
    ) -> tuple[QuerySet[Task], bool]:
        """Exact matches only, each answered by an index: id, key (the identity index), trace id, user id;
        or a payload value within a bounded window (engine/payload_search.py)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            by_payload = payload_search.parse(term)
        except payload_search.BadPayloadSearch as exc:
            messages.error(request, str(exc))
            return queryset.none(), False
        if by_payload is not None:
            found, bound = by_payload.apply(queryset)
            if bound is not None:
                messages.info(
                    request,
                    f"The payload search read the newest {payload_search.SCAN_LIMIT:,} tasks matching the filters "
                    f"(ids from {bound}); filter by type and created time to search older ones.",
                )
            return found, False
        return filtering.search(queryset, term), False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return super().changelist_view(request, {**(extra_context or {}), **live("#changelist-form")})

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        task = self.get_object(request, object_id)
        if task is not None and self.has_view_permission(request, task):
            extra_context = {**(extra_context or {}), **self.task_page(request, task), **live("#content-main")}
        return super().change_view(request, object_id, form_url, extra_context)

    def task_page(self, request: HttpRequest, task: Task) -> dict[str, Any]:
        """What the task page shows besides its fields: actions, attempts, dependencies, other versions, history."""
        actions = []
        in_history = getattr(task, "history_position", None)
        if self.has_operate_permission(request):
            # A task in history is read-only; retrying it is the one action, and brings it back.
            names = [n for n in applicable(task) if in_history is None or n == "retry_now"]
            for name in names:
                url = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_operate", args=[name])
                query = urlencode({"_selected_action": task.pk, "_from_task": 1, "select_across": 0})
                actions.append({"name": name, "label": OPERATIONS[name].label, "url": f"{url}?{query}"})
        versions = []
        if task.key is not None:
            versions = list(
                Task.objects.filter(task_type=task.task_type, key=task.key)
                .exclude(pk=task.pk)
                .order_by("-version")
                .only("id", "version", "status", "created_at")[:OTHER_VERSIONS_SHOWN]
            )
            # And those rolled into history (a key's versions may be in both).
            rolled = rolling.versions_in_history(task.task_type, task.key, OTHER_VERSIONS_SHOWN + 1)
            versions += [v for v in rolled if v.pk != task.pk]
            versions = sorted(versions, key=lambda v: -v.version)[:OTHER_VERSIONS_SHOWN]
        events = list(TaskEvent.objects.filter(task_id=task.pk).order_by("-at", "-id")[:EVENTS_SHOWN])
        for event in events:
            event.at_shown = display.timestamp(event.at)
        for version in versions:
            version.created_shown = display.timestamp(version.created_at)
        return {
            **periodic_context(task),
            "history_table": rolling.history_table(in_history) if in_history is not None else "",
            "history_url": reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_history"),
            "task_actions": actions,
            "attempts_log": attempts_log(task),
            **neighbours(task.pk, limit=NEIGHBOURS_SHOWN),
            "neighbours_shown": NEIGHBOURS_SHOWN,
            "other_versions": versions,
            "events": events,
            "events_url": reverse("admin:taskflow_taskevent_changelist") + "?" + urlencode({"q": task.pk}),
        }

    @admin.display(description="task")
    def task(self, task: Task) -> SafeString:
        # Break a long dotted type name at its dots rather than anywhere.
        name = format_html_join(SafeString(".<wbr>"), "{}", ((part,) for part in task.task_type.split(".")))
        lines = [format_html('<span class="tf-line tf-type-name">{}</span>', name)]
        if task.key is not None:
            lines.append(format_html('<span class="tf-line tf-quiet">{} @v{}</span>', task.key, task.version))
        if task.stage:
            lines.append(format_html('<span class="tf-line tf-quiet">stage {}</span>', task.stage))
        return SafeString("".join(lines))

    @admin.display(description="status")
    def state(self, task: Task) -> SafeString:
        lines = [display.status_badge(task.status)]
        bar = progress_rules.shown(task.progress, task.lease_token)
        if bar is not None:
            lines.append(format_html('<span class="tf-line">{}</span>', display.progress_bar(bar, compact=True)))
        if task.worker_id:
            where = "on" if task.status == Status.PROCESSING else "ran on"
            lines.append(format_html('<span class="tf-line tf-quiet">{} {}</span>', where, self.worker(task)))
        return SafeString("".join(lines))

    @admin.display(description="age / due")
    def when(self, task: Task) -> SafeString:
        due = self.due(task)
        lines = [format_html('<span class="tf-line">{}</span>', display.ago(task.created_at))]
        if due != display.EMPTY:
            lines.append(format_html('<span class="tf-line tf-quiet">due {}</span>', due))
        return SafeString("".join(lines))

    @admin.display(description="status")
    def status_badge(self, task: Task) -> SafeString:
        return display.status_badge(task.status)

    @admin.display(description="due")
    def due(self, task: Task) -> str:
        if task.status == Status.WAITING:
            return "after its dependencies"
        return display.relative(task.run_after) if task.status == Status.PENDING else display.EMPTY

    @admin.display(description="worker")
    def worker(self, task: Task) -> str:
        if not task.worker_id:
            return display.EMPTY
        if task.status != Status.PROCESSING:
            return task.worker_id
        return format_html('<a href="{}">{}</a>', display.tasks_url(worker=task.worker_id), task.worker_id)

    @admin.display(description="progress")
    def progress_block(self, task: Task) -> SafeString | str:
        return display.progress_bar(progress_rules.shown(task.progress, task.lease_token))

    @admin.display(description="max retries")
    def max_retries_shown(self, task: Task) -> str:
        if task.max_retries is not None:
            return str(task.max_retries)
        return f"{configs.get(task.task_type).max_retry_num} (type default)"

    @admin.display(description="timeout")
    def timeout_shown(self, task: Task) -> str:
        if task.timeout is not None:
            return f"{task.timeout} s"
        return f"{configs.get(task.task_type).max_processing_time} s (type default)"

    run_after_at = display.time_field("run_after", "run after")
    order_time_at = display.time_field("order_time", "order time")
    prefer_host_until_at = display.time_field("prefer_host_until", "prefer host until")
    lease_expires_at_at = display.time_field("lease_expires_at", "lease expires at")
    heartbeat_at_at = display.time_field("heartbeat_at", "heartbeat at")
    created_at_at = display.time_field("created_at", "created at")
    started_at_at = display.time_field("started_at", "started at")
    finished_at_at = display.time_field("finished_at", "finished at")
    updated_at_at = display.time_field("updated_at", "updated at")

    @admin.display(description="status message")
    def status_msg_block(self, task: Task) -> str:
        return display.text_block(task.status_msg)

    @admin.display(description="payload")
    def payload_block(self, task: Task) -> str:
        return display.pretty_json(task.payload)

    @admin.display(description="context")
    def context_block(self, task: Task) -> str:
        return display.pretty_json(task.context)

    @admin.display(description="checkpoint")
    def checkpoint_block(self, task: Task) -> str:
        return display.pretty_json(task.checkpoint)

    @admin.display(description="result")
    def result_block(self, task: Task) -> str:
        return display.pretty_json(task.result)


def periodic_context(task: Task) -> dict[str, Any]:
    """The schedule that fired the task (a tick, or "run now"), for the task page."""
    schedule = schedule_of(task)
    if schedule is None:
        return {}
    run_now = bool(task.key and task.key.endswith(MANUAL_SUFFIX))
    tick = None if run_now else datetime.fromtimestamp(task.version, UTC)
    return {"periodic_schedule": schedule, "periodic_run_now": run_now, "periodic_tick": tick}


def attempts_log(task: Task) -> list[dict[str, Any]]:
    """The schedule log (newest attempt first) as table rows, and a row wherever an operator made the task run again.

    Retry now and reschedule give a finished task a fresh retry budget, so its attempts count from
    1 again: the row between them says who retried it, and when.
    """
    rows = []
    for entry in task.schedule_log or []:
        if not isinstance(entry, dict):
            continue
        cost_ms = entry.get("cost_ms")
        started = parse_datetime(entry["started_at"]) if entry.get("started_at") else None
        rows.append(
            {
                "kind": "attempt",
                "attempt": entry.get("attempt"),
                "worker": entry.get("worker") or "",
                "started_at": started,
                "started": display.timestamp(started, ms=True),
                "duration": f"{cost_ms / 1000:.3f} s" if isinstance(cost_ms, (int, float)) else "",
                "outcome": entry.get("outcome") or "",
                "error": entry.get("error") or "",
            }
        )
    if not rows:
        return rows
    revivals = [
        {
            "kind": "revival",
            "at": event.at,
            "at_shown": display.timestamp(event.at, ms=True),
            "by": event.actor,
            "action": event.action.replace("_", " "),
            "was": (event.changes.get("status") or [""])[0],
            "reason": event.reason,
        }
        for event in revivals_of(task.pk, len(rows))
    ]
    # Newest first: each revival goes above the attempts that started before it.
    merged: list[dict[str, Any]] = []
    for row in rows:
        while revivals and row["started_at"] is not None and row["started_at"] < revivals[0]["at"]:
            merged.append(revivals.pop(0))
        merged.append(row)
    return merged
