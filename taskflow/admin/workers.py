"""Workers: which machine runs what. Each worker process with its host, pid, types and beat."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.contrib import admin
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..engine.workers import liveness_cutoff
from ..models import Status, Task, WorkerProcess
from . import display
from .listing import CappedChangeList, ReadOnlyAdmin

RUNNING_SHOWN = 10  # task links per worker; the rest behind "all N"


class AliveFilter(admin.SimpleListFilter):
    title = "alive"
    parameter_name = "alive"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("yes", "alive"), ("no", "silent")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[WorkerProcess]) -> QuerySet[WorkerProcess]:
        if self.value() == "yes":
            return queryset.filter(heartbeat_at__gte=liveness_cutoff())
        if self.value() == "no":
            return queryset.filter(heartbeat_at__lt=liveness_cutoff())
        return queryset


class WorkerChangeList(CappedChangeList):
    """Also loads, in one query, the tasks the listed workers run now (the small processing set)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        workers = {w.worker_id: w for w in self.result_list}
        running: dict[str, list[tuple[int, str]]] = defaultdict(list)
        rows = (
            Task.objects.filter(status=Status.PROCESSING, worker_id__in=list(workers))
            .order_by("started_at")
            .values_list("worker_id", "id", "task_type")
        )
        for worker_id, task_id, task_type in rows:
            running[worker_id].append((task_id, task_type))
        for worker_id, worker in workers.items():
            worker.running_tasks = running.get(worker_id, [])


@admin.register(WorkerProcess)
class WorkerProcessAdmin(ReadOnlyAdmin):
    list_display = ["host", "pid", "alive", "last_beat", "concurrency", "types_list", "running", "worker_id"]
    list_filter = [AliveFilter, "host"]
    search_fields = ["worker_id", "host"]
    ordering = ["host", "worker_id"]

    class Media:
        css = {"all": ["taskflow/console.css"]}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[CappedChangeList]:
        return WorkerChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerProcess]:
        # Judged by the database's clock, as taskwatch judges it.
        alive = ExpressionWrapper(Q(heartbeat_at__gte=liveness_cutoff()), output_field=BooleanField())
        return super().get_queryset(request).annotate(is_alive=alive)

    @admin.display(boolean=True, description="alive", ordering="-heartbeat_at")
    def alive(self, worker: WorkerProcess) -> bool:
        """Heartbeat seen within LIVENESS_TIMEOUT (a row can outlive a killed process until cleaned up)."""
        return bool(worker.is_alive)

    @admin.display(description="last heartbeat", ordering="heartbeat_at")
    def last_beat(self, worker: WorkerProcess) -> str:
        return display.relative(worker.heartbeat_at)

    @admin.display(description="task types")
    def types_list(self, worker: WorkerProcess) -> SafeString | str:
        """One type to a line (a worker may serve dozens: a Python list in one cell would widen the table)."""
        types = worker.task_types if isinstance(worker.task_types, list) else []
        if not types:
            return display.EMPTY
        return format_html('<ul class="tf-types">{}</ul>', format_html_join("", "<li>{}</li>", ((t,) for t in types)))

    @admin.display(description="running now")
    def running(self, worker: WorkerProcess) -> SafeString | str:
        tasks = getattr(worker, "running_tasks", None)
        if not tasks:
            return display.EMPTY
        links = format_html_join(
            ", ", '<a href="{}">{} {}</a>', ((display.task_url(i), t, i) for i, t in tasks[:RUNNING_SHOWN])
        )
        every = display.tasks_url(worker=worker.worker_id)
        return format_html('{} <a class="tf-all" href="{}">(all {})</a>', links, every, len(tasks))
