"""Coordination rows, read-only: table-rolling positions and named leases."""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import Lock, SchedulePos
from .listing import ReadOnlyAdmin


@admin.register(SchedulePos)
class SchedulePosAdmin(ReadOnlyAdmin):
    list_display = [
        "position",
        "browse",
        "started_at",
        "row_count",
        "min_id",
        "max_id",
        "newest_finished_at",
        "dropped_at",
    ]
    ordering = ["-position"]

    @admin.display(description="table")
    def browse(self, pos: SchedulePos) -> SafeString | str:
        if pos.dropped_at is not None:
            return "(dropped)"
        url = reverse("admin:taskflow_task_history") + f"?table={pos.position}"
        return format_html('<a href="{}">browse</a>', url)


@admin.register(Lock)
class LockAdmin(ReadOnlyAdmin):
    list_display = ["name", "owner", "expires_at", "held"]
    search_fields = ["name", "owner"]
    ordering = ["name"]

    @admin.display(boolean=True, description="held")
    def held(self, lock: Lock) -> bool:
        return lock.expires_at > timezone.now()
