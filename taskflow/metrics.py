"""/metrics: the statistics rollup in Prometheus text format, for a staff session or a bearer token.

Every number comes from the rollup taskwatch keeps in the database (engine/stats.py), through a
collector that reads it at each scrape, instead of prometheus-client's counters in process memory:
workers, taskwatch and each web process are separate processes (often on several hosts), so a
counter in one of them would count only its own share, start again at 0 with every restart, and
differ from one scrape to the next depending on which web process answered. The database is the
one place that sees every claim and report. Counters and the histogram are built only from
final minutes (engine/stats.py SETTLE_S), so they never go backwards; they lag by about two
minutes, which rate() over a few minutes absorbs.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterator
from datetime import datetime

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .engine import stats

TOKEN_ENV = "TASKFLOW_METRICS_TOKEN"
VIEW_PERMISSION = "taskflow.view_task"


class RollupCollector:
    """Builds every taskflow metric from the rollup when scraped."""

    def collect(self) -> Iterator[Metric]:
        now = stats.current(window_s=60)
        totals = stats.totals()
        types = now["types"]
        tasks = GaugeMetricFamily(
            "taskflow_tasks", "Tasks by type and status (as last counted)", labels=["task_type", "status"]
        )
        oldest = GaugeMetricFamily(
            "taskflow_oldest_pending_age_seconds",
            "How long the next task to be claimed has been due (0 when none is due)",
            labels=["task_type"],
        )
        in_flight = GaugeMetricFamily("taskflow_in_flight", "Tasks being processed now", labels=["task_type"])
        limit = GaugeMetricFamily(
            "taskflow_concurrency_limit", "The type's concurrency limit (limited types only)", labels=["task_type"]
        )
        paused = GaugeMetricFamily("taskflow_paused", "1 while the type is paused", labels=["task_type"])
        for task_type, t in types.items():
            for status, n in t["counts"].items():
                tasks.add_metric([task_type, status], n)
            oldest.add_metric([task_type], t["oldest_pending_age_s"] or 0.0)
            in_flight.add_metric([task_type], t["in_flight"])
            if t["limit"] is not None:
                limit.add_metric([task_type], t["limit"])
            paused.add_metric([task_type], 1 if t["paused"] else 0)
        yield from (tasks, oldest, in_flight, limit, paused)

        claims = CounterMetricFamily(
            "taskflow_claims",
            "Attempts claimed for tasks that have finished (counted when the task finishes)",
            labels=["task_type"],
        )
        completions = CounterMetricFamily("taskflow_completions", "Tasks that succeeded", labels=["task_type"])
        failures = CounterMetricFamily("taskflow_failures", "Tasks that failed for good", labels=["task_type"])
        stops = CounterMetricFamily("taskflow_stops", "Tasks stopped (terminated, superseded)", labels=["task_type"])
        run_time = HistogramMetricFamily(
            "taskflow_run_time_seconds", "Run time of the last attempt of finished tasks", labels=["task_type"]
        )
        bounds = [f"{ms / 1000:g}" for ms in stats.RUN_TIME_BOUNDS_MS] + ["+Inf"]
        for task_type in types:
            total = totals.get(task_type)
            if not total:
                continue
            claims.add_metric([task_type], total["attempts"])
            completions.add_metric([task_type], total["completed"])
            failures.add_metric([task_type], total["failed"])
            stops.add_metric([task_type], total["stopped"])
            cumulative, running = [], 0
            for bound, n in zip(bounds, total["run_time_buckets"], strict=True):
                running += n
                cumulative.append((bound, running))
            run_time.add_metric([task_type], cumulative, sum_value=total["run_time_sum_ms"] / 1000)
        yield from (claims, completions, failures, stops, run_time)

        refreshed = GaugeMetricFamily(
            "taskflow_stats_refreshed_timestamp_seconds", "When taskwatch last refreshed these numbers"
        )
        refreshed.add_metric([], datetime.fromisoformat(now["generated_at"]).timestamp())
        yield refreshed


def refusal(request: HttpRequest) -> HttpResponse | None:
    """Why this request may not read the metrics (401 or 403), or None if it may."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        expected = os.environ.get(TOKEN_ENV, "")
        # compare_digest takes as long whatever the first wrong character: no timing oracle.
        if expected and hmac.compare_digest(token.strip().encode(), expected.encode()):
            return None
        return _plain(403, "Wrong metrics token.")
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        if user.is_active and user.is_staff and user.has_perm(VIEW_PERMISSION):
            return None
        return _plain(403, "Staff with the view_task permission only.")
    response = _plain(401, f"Log in as staff, or send Authorization: Bearer <{TOKEN_ENV}>.")
    response["WWW-Authenticate"] = 'Bearer realm="taskflow metrics"'
    return response


def _plain(status: int, text: str) -> HttpResponse:
    return HttpResponse(text + "\n", status=status, content_type="text/plain; charset=utf-8")


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus text format."""
    refused = refusal(request)
    if refused is not None:
        return refused
    # A registry of its own: the process-global one would add this web process's own metrics.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RollupCollector())  # type: ignore[arg-type]
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
