"""The operator console: tasks and workers to inspect, schedule configs to edit live.

Task rows are read-only here: every change to a task goes through the core's guarded updates,
never through a model form that could overwrite a worker's concurrent report.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from ..conf import get_settings
from ..models import Lock, ScheduleCfg, SchedulePos, Task, WorkerProcess

admin.site.site_header = "taskflow console"
admin.site.site_title = "taskflow"
admin.site.index_title = "Tasks, workers and schedule configuration"


def pretty_json(value: Any) -> str:
    """Render a JSON value as an indented block."""
    if value in (None, "", {}, []):
        return "-"
    return format_html("<pre style='margin:0;white-space:pre-wrap'>{}</pre>", json.dumps(value, indent=2))


class ReadOnlyAdmin(admin.ModelAdmin):
    """Viewable by staff with the view permission; nothing can be added, changed or deleted."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class TaskTypeFilter(admin.SimpleListFilter):
    """Task types as listed in ScheduleCfg, which has a row for every type ever enqueued."""

    # A DISTINCT over the task table would scan it; the config table is tiny.
    title = "task type"
    parameter_name = "task_type"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(t, t) for t in ScheduleCfg.objects.order_by("task_type").values_list("task_type", flat=True)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Task]) -> QuerySet[Task]:
        return queryset.filter(task_type=self.value()) if self.value() else queryset


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "task_type",
        "key",
        "version",
        "status",
        "priority",
        "attempts",
        "stage",
        "run_after",
        "worker_id",
        "updated_at",
    ]
    list_filter = ["status", TaskTypeFilter, "stage"]
    # Exact matches only, so a search uses the id or trace id instead of scanning every row.
    search_fields = ["id__exact", "key__exact", "trace_id__exact"]
    search_help_text = "Exact task id, key or trace id."
    date_hierarchy = "created_at"
    ordering = ["-id"]
    show_full_result_count = False
    list_per_page = 50
    fieldsets = [
        (None, {"fields": ["id", "task_type", "key", "version", "priority", "trace_id", "user_id"]}),
        ("State", {"fields": ["status", "status_msg_block", "stage", "attempts", "max_retries", "timeout"]}),
        ("Schedule", {"fields": ["run_after", "order_time", "prefer_host", "prefer_host_until"]}),
        ("Lease", {"fields": ["worker_id", "lease_token", "lease_expires_at", "heartbeat_at"]}),
        ("Data", {"fields": ["payload_block", "context_block", "checkpoint_block", "result_block"]}),
        (
            "History",
            {"fields": ["schedule_log_block", "created_at", "updated_at", "started_at", "finished_at"]},
        ),
    ]
    readonly_fields = [
        "id",
        "task_type",
        "key",
        "version",
        "priority",
        "trace_id",
        "user_id",
        "status",
        "status_msg_block",
        "stage",
        "attempts",
        "max_retries",
        "timeout",
        "run_after",
        "order_time",
        "prefer_host",
        "prefer_host_until",
        "worker_id",
        "lease_token",
        "lease_expires_at",
        "heartbeat_at",
        "payload_block",
        "context_block",
        "checkpoint_block",
        "result_block",
        "schedule_log_block",
        "created_at",
        "updated_at",
        "started_at",
        "finished_at",
    ]

    @admin.display(description="status message")
    def status_msg_block(self, task: Task) -> str:
        if not task.status_msg:
            return "-"
        return format_html("<pre style='margin:0;white-space:pre-wrap'>{}</pre>", task.status_msg)

    @admin.display(description="payload")
    def payload_block(self, task: Task) -> str:
        return pretty_json(task.payload)

    @admin.display(description="context")
    def context_block(self, task: Task) -> str:
        return pretty_json(task.context)

    @admin.display(description="checkpoint")
    def checkpoint_block(self, task: Task) -> str:
        return pretty_json(task.checkpoint)

    @admin.display(description="result")
    def result_block(self, task: Task) -> str:
        return pretty_json(task.result)

    @admin.display(description="schedule log (newest first)")
    def schedule_log_block(self, task: Task) -> str:
        return pretty_json(task.schedule_log)


@admin.register(ScheduleCfg)
class ScheduleCfgAdmin(admin.ModelAdmin):
    """The live per-type configuration: workers re-read it every CONFIG_REFRESH seconds."""

    list_display = [
        "task_type",
        "paused",
        "concurrency_limit",
        "schedule_limit",
        "schedule_interval",
        "max_processing_time",
        "max_retry_num",
        "retry_strategy",
        "priority_aging",
        "updated_at",
    ]
    list_editable = ["paused", "concurrency_limit"]
    list_filter = ["paused", "retry_strategy"]
    search_fields = ["task_type"]
    ordering = ["task_type"]
    readonly_fields = ["updated_at"]
    fieldsets = [
        (None, {"fields": ["task_type", "paused", "updated_at"]}),
        ("Claiming", {"fields": ["schedule_limit", "schedule_interval", "concurrency_limit", "priority_aging"]}),
        (
            "Attempts and retries",
            {
                "fields": [
                    "max_processing_time",
                    "max_retry_num",
                    "retry_strategy",
                    "retry_interval",
                    "max_retry_interval",
                    "retry_jitter",
                ]
            },
        ),
        ("Expiry", {"fields": ["pending_timeout", "success_retention", "purge_after_days"]}),
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: ScheduleCfg | None = None) -> list[str]:
        # The task type is the primary key: renaming it would detach the config from its tasks.
        return [*self.readonly_fields, "task_type"] if obj is not None else list(self.readonly_fields)


@admin.register(SchedulePos)
class SchedulePosAdmin(ReadOnlyAdmin):
    list_display = ["task_type", "schedule_begin_pos", "schedule_end_pos", "updated_at"]
    ordering = ["task_type"]


@admin.register(WorkerProcess)
class WorkerProcessAdmin(ReadOnlyAdmin):
    list_display = ["worker_id", "alive", "host", "pid", "concurrency", "task_types", "started_at", "heartbeat_at"]
    list_filter = ["host"]
    search_fields = ["worker_id", "host"]
    ordering = ["host", "worker_id"]

    @admin.display(boolean=True, description="alive")
    def alive(self, worker: WorkerProcess) -> bool:
        """Heartbeat seen within LIVENESS_TIMEOUT (a row can outlive a killed process until cleaned up)."""
        return worker.heartbeat_at >= timezone.now() - timedelta(seconds=get_settings().LIVENESS_TIMEOUT)


@admin.register(Lock)
class LockAdmin(ReadOnlyAdmin):
    list_display = ["name", "owner", "expires_at", "held"]
    search_fields = ["name", "owner"]
    ordering = ["name"]

    @admin.display(boolean=True, description="held")
    def held(self, lock: Lock) -> bool:
        return lock.expires_at > timezone.now()
