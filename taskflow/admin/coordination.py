"""Coordination rows, read-only: table-rolling positions and named leases."""

from __future__ import annotations

from django.contrib import admin
from django.utils import timezone

from ..models import Lock, SchedulePos
from .listing import ReadOnlyAdmin


@admin.register(SchedulePos)
class SchedulePosAdmin(ReadOnlyAdmin):
    list_display = ["task_type", "schedule_begin_pos", "schedule_end_pos", "updated_at"]
    ordering = ["task_type"]


@admin.register(Lock)
class LockAdmin(ReadOnlyAdmin):
    list_display = ["name", "owner", "expires_at", "held"]
    search_fields = ["name", "owner"]
    ordering = ["name"]

    @admin.display(boolean=True, description="held")
    def held(self, lock: Lock) -> bool:
        return lock.expires_at > timezone.now()
