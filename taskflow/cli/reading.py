"""What the read subcommands show: the status of every type and the fleet, a task list, one task's page.

Each returns plain data (what `--json` prints) and has a `*_text` twin that lays it out for people.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from django.db import models
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ..engine import rolling, stats
from ..engine.dependencies import neighbours
from ..engine.operations import applicable
from ..engine.workers import liveness_cutoff
from ..models import ScheduleCfg, Status, Task, TaskEvent, WorkerProcess
from .output import EMPTY, cell, compact_json, fields, since, span, table, to_json

# What a list reads of each row: the short columns only, never the JSON or text ones (a payload or
# a traceback may hold a megabyte each); `show` reads those.
LIST_COLUMNS = tuple(
    f.attname for f in Task._meta.concrete_fields if not isinstance(f, (models.JSONField, models.TextField))
)
# --order: newest and oldest walk the primary key (ids are time-ordered); due is the claim order,
# read from the claim index (status, task_type, order_time) when --status pending (and --type) are given.
ORDERINGS = {"newest": ("-id",), "oldest": ("id",), "due": ("order_time", "id")}
EVENTS_SHOWN = 50
NEIGHBOURS_SHOWN = 50


# -- status ----------------------------------------------------------------------------------------


def status(minutes: int = 5) -> dict[str, Any]:
    """Per type: counts by status, in flight against its limit, the oldest pending wait, throughput; and the fleet.

    Numbers come from the rollup taskwatch keeps (engine/stats.py), as of `generated_at`;
    throughput counts the tasks finished in the last `minutes` minutes, the current one partial.
    """
    current = stats.current(window_s=minutes * 60)
    generated = parse_datetime(current["generated_at"])
    types = {}
    for name, numbers in current["types"].items():
        recent = numbers["per_minute"][-minutes:]
        completed = sum(m["completed"] for m in recent)
        failed = sum(m["failed"] for m in recent)
        types[name] = {
            "paused": numbers["paused"],
            "counts": numbers["counts"],
            "in_flight": numbers["in_flight"],
            "limit": numbers["limit"],
            "oldest_pending_age_s": numbers["oldest_pending_age_s"],
            "throughput": {
                "minutes": minutes,
                "completed": completed,
                "failed": failed,
                "completed_per_minute": round(completed / minutes, 2),
            },
            "success_rate": numbers["success_rate"],
            "run_time_ms": numbers["run_time_ms"],
        }
    return {
        "generated_at": generated,
        "age_s": round((timezone.now() - generated).total_seconds(), 1) if generated else None,
        "types": types,
        "fleet": fleet(),
    }


def fleet() -> dict[str, Any]:
    """The worker processes: alive ones (a beat within LIVENESS_TIMEOUT, by the database's clock) and silent ones."""
    alive = ExpressionWrapper(Q(heartbeat_at__gte=liveness_cutoff()), output_field=BooleanField())
    workers = list(WorkerProcess.objects.annotate(alive=alive).order_by("host", "worker_id"))
    running = Counter(
        Task.objects.filter(status=Status.PROCESSING, worker_id__in=[w.worker_id for w in workers]).values_list(
            "worker_id", flat=True
        )
    )
    live = [w for w in workers if w.alive]
    return {
        "alive": len(live),
        "silent": len(workers) - len(live),
        "hosts": sorted({w.host for w in live}),
        "concurrency": sum(w.concurrency for w in live),
        "workers": [
            {
                "worker_id": w.worker_id,
                "host": w.host,
                "pid": w.pid,
                "alive": bool(w.alive),
                "task_types": w.task_types,
                "concurrency": w.concurrency,
                "running": running.get(w.worker_id, 0),
                "started_at": w.started_at,
                "heartbeat_at": w.heartbeat_at,
            }
            for w in workers
        ],
    }


def status_text(report: dict[str, Any]) -> str:
    now = timezone.now()
    minutes = next(iter(report["types"].values()), {}).get("throughput", {}).get("minutes", 0)
    out = [f"Task types (counted by taskwatch at {cell(report['generated_at'])}, {since(report['generated_at'], now)})"]
    rows = []
    for name, t in report["types"].items():
        counts = t["counts"]
        age = t["oldest_pending_age_s"]
        rows.append(
            [
                name,
                "paused" if t["paused"] else "active",
                *(counts.get(s, 0) for s in Status.values),
                f"{t['in_flight']}/{t['limit']}" if t["limit"] else t["in_flight"],
                span(age) if age is not None else EMPTY,
                t["throughput"]["completed"],
                t["throughput"]["failed"],
            ]
        )
    headers = ["TYPE", "STATE", *(s.upper() for s in Status.values), "IN FLIGHT", "OLDEST PENDING"]
    headers += [f"DONE {minutes}M", f"FAILED {minutes}M"]
    out.append(table(headers, rows) if rows else "(no task types yet)")
    f = report["fleet"]
    out += ["", f"Workers: {f['alive']} alive on {len(f['hosts'])} host(s), {f['concurrency']} threads"]
    if f["silent"]:
        out[-1] += f"; {f['silent']} silent (no beat within the liveness timeout)"
    if f["workers"]:
        out.append(
            table(
                ["HOST", "PID", "ALIVE", "LAST BEAT", "CONCURRENCY", "RUNNING", "WORKER", "TYPES"],
                [
                    [
                        w["host"],
                        w["pid"],
                        w["alive"],
                        since(w["heartbeat_at"], now),
                        w["concurrency"],
                        w["running"],
                        w["worker_id"],
                        _some(w["task_types"]),
                    ]
                    for w in f["workers"]
                ],
            )
        )
    return "\n".join(out)


def _some(names: list[str], shown: int = 3) -> str:
    """A few names and how many more (a worker may serve dozens of types; --json lists them all)."""
    more = len(names) - shown
    return ",".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


# -- list ------------------------------------------------------------------------------------------


def task_list(queryset: QuerySet[Task], *, limit: int, order: str) -> tuple[list[dict[str, Any]], bool]:
    """The first `limit` matching tasks in `order`, without their JSON columns; and whether more match."""
    rows = list(queryset.order_by(*ORDERINGS[order]).values(*LIST_COLUMNS)[: limit + 1])
    return rows[:limit], len(rows) > limit


def list_text(rows: list[dict[str, Any]], more: bool) -> str:
    now = timezone.now()
    body = table(
        ["ID", "TYPE", "KEY", "STATUS", "STAGE", "PRIORITY", "ATTEMPTS", "DUE", "WORKER", "AGE"],
        [
            [
                r["id"],
                r["task_type"],
                f"{r['key']}@v{r['version']}" if r["key"] is not None else EMPTY,
                r["status"],
                r["stage"],
                r["priority"],
                r["attempts"],
                _due(r, now),
                r["worker_id"] if r["status"] == Status.PROCESSING else EMPTY,
                since(r["created_at"], now).removesuffix(" ago"),
            ]
            for r in rows
        ],
    )
    if not rows:
        return "no task matches"
    if more:
        body += f"\n(first {len(rows)} shown; more match: narrow the filter or raise --limit)"
    return body


def _due(row: dict[str, Any], now: datetime) -> str:
    if row["status"] == Status.WAITING:
        return "after its dependencies"
    return since(row["run_after"], now) if row["status"] == Status.PENDING else EMPTY


# -- show ------------------------------------------------------------------------------------------


def task_page(task_id: int) -> dict[str, Any]:
    """Everything the console's task page shows, as data; raises Task.DoesNotExist."""
    task = rolling.get_task(task_id)
    cfg = ScheduleCfg.objects.filter(task_type=task.task_type).first()
    position = getattr(task, "history_position", None)
    data = {f.attname: getattr(task, f.attname) for f in Task._meta.concrete_fields}
    data["key"] = task.key
    events = TaskEvent.objects.filter(task_id=task.pk).order_by("-at", "-id")[:EVENTS_SHOWN]
    return {
        "task": data,
        # The values that apply where the task has none of its own (README: Retries, Leases).
        "effective": {
            "max_retries": _effective(task.max_retries, cfg.max_retry_num if cfg else None),
            "timeout": _effective(task.timeout or None, cfg.max_processing_time if cfg else None),
        },
        "history_table": rolling.history_table(position) if position is not None else None,
        # A rolled task is read-only; retrying it is the one operation, and brings it back.
        "applicable": [n for n in applicable(task) if position is None or n == "retry_now"],
        "attempts": [e for e in task.schedule_log or [] if isinstance(e, dict)],
        "events": [
            {"at": e.at, "actor": e.actor, "action": e.action, "reason": e.reason, "changes": e.changes} for e in events
        ],
        **neighbours(task.pk, limit=NEIGHBOURS_SHOWN),
    }


def _effective(own: int | None, default: int | None) -> dict[str, Any]:
    if own is not None:
        return {"value": own, "source": "task"}
    return {"value": default, "source": "type default"}


def page_text(page: dict[str, Any]) -> str:
    t, eff = page["task"], page["effective"]
    now = timezone.now()

    def effective(name: str, unit: str = "") -> str:
        value = eff[name]["value"]
        shown = EMPTY if value is None else f"{value}{unit}"
        return shown + (" (type default)" if eff[name]["source"] == "type default" else "")

    title = f"Task {t['id']}  {t['task_type']}  [{t['status']}]"
    if page["history_table"]:
        title += f"  (rolled into {page['history_table']}, read-only but for retry)"
    out = [
        title,
        fields(
            [
                ("key", f"{t['key']} @v{t['version']}" if t["key"] is not None else None),
                ("superseded by", t["superseded_by"]),
                ("stage", t["stage"]),
                ("priority", t["priority"]),
                ("attempts", t["attempts"]),
                ("max retries", effective("max_retries")),
                ("timeout", effective("timeout", " s")),
                ("trace id", t["trace_id"]),
                ("user id", t["user_id"]),
                ("run after", _when(t["run_after"], now)),
                ("worker", t["worker_id"]),
                ("lease", f"token {t['lease_token']}, expires {_when(t['lease_expires_at'], now)}"),
                ("heartbeat", _when(t["heartbeat_at"], now)),
                ("created", _when(t["created_at"], now)),
                ("started", _when(t["started_at"], now)),
                ("finished", _when(t["finished_at"], now)),
                ("updated", _when(t["updated_at"], now)),
                ("actions", ", ".join(page["applicable"]) or None),
            ]
        ),
    ]
    if t["status_msg"]:
        out += ["", "Status message", _indent(t["status_msg"])]
    if page["attempts"]:
        rows = [
            [
                a.get("attempt"),
                cell(parse_datetime(a["started_at"])) if a.get("started_at") else EMPTY,
                f"{a['cost_ms'] / 1000:.3f} s" if isinstance(a.get("cost_ms"), (int, float)) else EMPTY,
                a.get("worker"),
                a.get("outcome"),
                a.get("error"),
            ]
            for a in reversed(page["attempts"])
        ]
        out += ["", "Attempts (newest first)", table(["#", "STARTED", "DURATION", "WORKER", "OUTCOME", "ERROR"], rows)]
    for title, key in (("Depends on", "dependencies"), ("Dependents", "dependents")):
        if page[key]:
            rows = [[n["id"], n["task_type"], n["status"], "run" if n["run_on_failure"] else "stop"] for n in page[key]]
            out += ["", title, table(["ID", "TYPE", "STATUS", "ON FAILURE"], rows)]
    if page["events"]:
        rows = [[e["at"], e["actor"], e["action"], e["reason"], compact_json(e["changes"])] for e in page["events"]]
        out += ["", "History (newest first)", table(["AT", "ACTOR", "ACTION", "REASON", "CHANGES"], rows)]
    for name in ("payload", "context", "checkpoint", "result"):
        if t[name] not in (None, {}, [], ""):
            out += ["", name.capitalize(), _indent(to_json(t[name]))]
    return "\n".join(out)


def _when(value: datetime | None, now: datetime) -> str:
    return f"{cell(value)} ({since(value, now)})" if value is not None else EMPTY


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
