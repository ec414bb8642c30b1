"""What workers say: the start-up banner, one line per attempt's outcome, and the console logging they set up.

`taskworker`, `taskwatch` and `python -m taskflow.remote` call `configure` with their `--loglevel`
/ `-l`, Django's `-v` and `--log-format`; the runtime calls `worker_banner` (or the remote and
watcher ones) as it starts, and `attempts_ended` / `remote_attempt_ended` once an attempt's
outcome is known (after its report was written, so a retry's time is the one the database holds).

Per-attempt lines go to the "taskflow.tasks" logger at INFO: `-l WARNING` (or `-v 0`) turns them
off, and then they cost one `isEnabledFor` per batch of reports. Their message is %-formatted by
the handler, only if a handler emits the record.

Nothing here imports Django at module level: the remote worker runs without Django settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from ..engine import registry
from ..engine.tasklog import NONE, TaskLogFilter

TASKS_LOGGER = "taskflow.tasks"
tasks_log = logging.getLogger(TASKS_LOGGER)

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Django's -v: 0 quiet, 1 normal (the default), 2 verbose, 3 very verbose.
VERBOSITY_LEVELS = {0: "WARNING", 1: "INFO", 2: "DEBUG", 3: "DEBUG"}


# -- options and set-up ------------------------------------------------------------------------------


def level_name(text: str) -> str:
    """argparse type for --loglevel: a level name, in any case ("info", "INFO")."""
    name = text.strip().upper()
    if name not in LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LEVELS)}; got {text!r}")
    return name


def add_arguments(parser: argparse.ArgumentParser, *, default_level: str | None = None) -> None:
    """Add -l/--loglevel and --log-format to a command's parser."""
    parser.add_argument(
        "-l",
        "--loglevel",
        "--log-level",
        dest="loglevel",
        type=level_name,
        default=default_level,
        help="DEBUG, INFO (a line per task), WARNING or ERROR"
        + (f" (default {default_level})" if default_level else " (default from -v: 0 WARNING, 1 INFO, 2 DEBUG)"),
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text lines, or one JSON object per line (default text; only for the console taskflow sets up)",
    )


def configure(
    level: str | None = None, *, verbosity: int | None = None, log_format: str = "text", logger: str = "taskflow"
) -> bool:
    """Log `logger` to stderr at the chosen level, unless the project already logs it; True if set up here.

    The level is `level` if given, else Django's `verbosity` (0 WARNING, 1 INFO, 2 and 3 DEBUG).
    The project's own logging wins when any handler would already receive `logger`'s records (one on
    it or on an ancestor it propagates to, the root logger included; Django's default LOGGING puts
    none there): then no handler is added, and the level is set only if the command line chose one
    (`-l`, or a `-v` other than the default 1).
    """
    target = logging.getLogger(logger)
    for handler in [h for h in target.handlers if getattr(h, "taskflow_console", False)]:
        target.removeHandler(handler)  # set up again by a second command in this process
    chosen = level or VERBOSITY_LEVELS.get(verbosity if verbosity is not None else 1, "DEBUG")
    if target.hasHandlers():
        if level is not None or verbosity not in (None, 1):
            target.setLevel(chosen)
        return False
    handler = logging.StreamHandler(sys.stderr)
    handler.taskflow_console = True  # type: ignore[attr-defined]
    handler.addFilter(TaskLogFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    target.addHandler(handler)
    target.setLevel(chosen)
    return True


# Attributes every LogRecord has; the others were given by `extra` (or a filter) and go into JSON.
_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, task_id, trace_id, and every `extra` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("task_id", "trace_id"):
            # Text, as the API gives ids: a snowflake id is past what a JSON reader's double holds.
            value = getattr(record, name, NONE)
            entry[name] = None if value == NONE else str(value)
        for name, value in record.__dict__.items():
            if name not in _RECORD_ATTRIBUTES and name not in entry:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


# -- the banner ----------------------------------------------------------------------------------------


def version() -> str:
    """taskflow's version: `taskflow.__version__`, else the installed distribution's, else "unknown"."""
    import taskflow

    found = getattr(taskflow, "__version__", None)
    if found:
        return str(found)
    from importlib import metadata

    try:
        return metadata.version("taskflow")
    except metadata.PackageNotFoundError:
        return "unknown"


def redact_url(url: str) -> str:
    """`url` without its password (user:***@host), nor one given in its query string."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparsable URL)"
    redacted = url
    if "@" in parts.netloc:
        user_info, host = parts.netloc.rsplit("@", 1)
        user = user_info.split(":", 1)[0]
        redacted = redacted.replace(parts.netloc, f"{user}:***@{host}" if ":" in user_info else parts.netloc, 1)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if any(k.lower() in _SECRET_PARAMETERS for k, _ in pairs):
        hidden = [(k, "***" if k.lower() in _SECRET_PARAMETERS else v) for k, v in pairs]
        head, _, _ = redacted.partition("?")
        redacted = f"{head}?{urlencode(hidden, safe='*')}" + (f"#{parts.fragment}" if parts.fragment else "")
    return redacted


_SECRET_PARAMETERS = frozenset({"password", "pass", "token"})


def database_in_use(alias: str = "default") -> str:
    """The database a Django process uses, as "engine host:port/name" (never its user's password)."""
    from django.db import connections

    connection = connections[alias]
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite {db.get('NAME')}"
    host = db.get("HOST") or "localhost"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"{connection.vendor} {host}{port}/{db.get('NAME')}"


def redis_in_use() -> str:
    """The Redis URL(s) of TASKFLOW's REDIS_ALIAS, with no password; "none" when taskflow runs without Redis."""
    from django.conf import settings

    from ..conf import get_settings

    alias = get_settings().REDIS_ALIAS
    if not alias:
        return "none"
    location = settings.CACHES.get(alias, {}).get("LOCATION", "")
    locations = location if isinstance(location, list | tuple) else str(location).split(",")
    return ",".join(redact_url(str(url).strip()) for url in locations if str(url).strip())


def worker_banner(worker: Any) -> None:
    """The local worker's start-up line: version, id, database, Redis, concurrency, types."""
    if not logging.getLogger("taskflow.worker").isEnabledFor(logging.INFO):
        return
    fields = {"worker_id": worker.worker_id, "database": database_in_use(), "redis": redis_in_use()}
    fields.update(concurrency=worker.concurrency, async_concurrency=worker.async_concurrency, burst=worker.burst)
    fields.update(types=list(worker.task_types))
    _banner("taskflow.worker", f"worker {worker.worker_id}", fields, _serving(worker))


def watcher_banner(watcher: Any, *, once: bool = False) -> None:
    """taskwatch's start-up line: version, id, database, Redis, how often it passes."""
    if not logging.getLogger("taskflow.watch").isEnabledFor(logging.INFO):
        return
    fields = {"watcher_id": watcher.leadership.owner, "database": database_in_use(), "redis": redis_in_use()}
    fields.update(interval_s=None if once else watcher.interval, leader_ttl_s=watcher.leadership.ttl)
    passes = "one pass" if once else f"a pass every {watcher.interval:g}s"
    _banner(
        "taskflow.watch",
        f"taskwatch {watcher.leadership.owner}",
        fields,
        f"{passes}, leader ttl {fields['leader_ttl_s']:g}s",
    )


def remote_worker_banner(worker: Any) -> None:
    """The remote worker's start-up line: version, API (no credentials), host, concurrency, types."""
    if not logging.getLogger("taskflow.remote").isEnabledFor(logging.INFO):
        return
    fields = {"api": redact_url(worker.client.root), "host": socket.gethostname(), "pid": os.getpid()}
    fields.update(concurrency=worker.concurrency, async_concurrency=worker.async_concurrency, burst=worker.burst)
    fields.update(types=list(worker.task_types))
    # Its worker id is issued by the server at registration, and logged then.
    _banner(
        "taskflow.remote", "remote worker", fields, f"host {fields['host']} pid {fields['pid']}, {_serving(worker)}"
    )


def _serving(worker: Any) -> str:
    burst = " (burst)" if worker.burst else ""
    # async def handlers run on an event loop with a capacity of their own, shown when any is served.
    serves_async = any(registry.is_async(t) for t in worker.task_types)
    capacity = f", async {worker.async_concurrency}" if serves_async else ""
    return f"concurrency {worker.concurrency}{capacity}{burst}, types {','.join(worker.task_types)}"


def _banner(logger: str, who: str, fields: dict[str, Any], rest: str) -> None:
    """ "taskflow <version> <who> starting: [api ..., ][database ..., redis ..., ]<rest>", `fields` as extra."""
    fields["version"] = version()
    where = [f"{name} {fields[name]}" for name in ("api", "database", "redis") if name in fields]
    message = "taskflow %s %s starting: %s"
    logging.getLogger(logger).info(message, fields["version"], who, ", ".join([*where, rest]), extra=fields)


# -- one line per attempt -------------------------------------------------------------------------------

# The message of every per-attempt line; %-formatted only when a handler emits it.
LINE = "task %s[%s] attempt %s%s: %s%s"


def _line(
    task: Any, outcome: str, words: str, duration_ms: int | None, error: str = "", traceback: str = "", **more: Any
) -> None:
    extra: dict[str, Any] = {
        "task_id": task.id,
        "trace_id": task.trace_id or NONE,
        "task_type": task.task_type,
        "attempt": task.attempt,
        "outcome": outcome,
        "duration_ms": duration_ms,
        **more,
    }
    if error:
        extra["error"] = error
    if traceback:
        extra["traceback"] = traceback
    took = "" if duration_ms is None else f" took {duration_ms} ms"
    said = f": {error}" if error else ""
    if traceback and tasks_log.isEnabledFor(logging.DEBUG):
        said += "\n" + traceback.rstrip("\n")
    # Logger.info() would look up the caller's frame (findCaller: a fifth of a line's cost with a plain
    # StreamHandler, at thousands of lines a second); the caller is always this function.
    args = (task.task_type, task.id, task.attempt, took, words, said)
    tasks_log.handle(
        tasks_log.makeRecord(tasks_log.name, logging.INFO, __file__, _LINENO, LINE, args, None, "_line", extra)
    )


_LINENO = _line.__code__.co_firstlineno


def attempts_ended(reports: Iterable[Any]) -> None:
    """One INFO line per local attempt ended (engine.attempts.Report), told by what its report wrote.

    Called after `finish_attempts`: a report it did not write (`written` None) lost its attempt.
    """
    if not tasks_log.isEnabledFor(logging.INFO):
        return
    now = datetime.now(UTC)
    for report in reports:
        task, outcome, written = report.task, str(report.outcome), report.written
        ran = report.cost_ms
        if outcome == "handback":
            if written is not None:
                _line(task, "handed_back", "handed back unstarted", None)
            continue
        if written is None:
            _line(task, "lost", "lost (taken away while it ran; its report was refused)", ran)
            continue
        status = written.get("status")
        if status == "success":
            _line(task, "success", "success", ran)
        elif status == "failed":
            _line(task, "failed", "failed", ran, report.error, report.detail)
        elif status == "stopped":
            _line(task, "stopped", f"stopped ({written.get('status_msg', '')})", ran, report.error, report.detail)
        elif status == "pending" and outcome == "snooze":
            at = written["run_after"]
            _line(task, "snoozed", f"snoozed until {_when(at, now)}", ran, report.error, retry_at=at.isoformat())
        elif status == "pending" and outcome == "next_stage":
            stage = report.next_stage.stage if report.next_stage is not None else written.get("stage")
            _line(task, "next_stage", f"next stage {stage!r} at {_when(written['run_after'], now)}", ran, stage=stage)
        elif status == "pending":
            at = written["run_after"]
            words = f"retry at {_when(at, now)}"
            _line(task, "retry", words, ran, report.error, report.detail, retry_at=at.isoformat())


def _when(at: datetime, now: datetime) -> str:
    seconds = (at - now).total_seconds()
    return f"{at.isoformat(timespec='milliseconds')} (in {max(0.0, seconds):.1f}s)"


def remote_attempt_ended(attempt: Any, item: dict[str, Any] | None, *, applied: bool) -> None:
    """One INFO line for a remote attempt whose report the server applied (or refused: the attempt was lost).

    The server applies its retry policy and does not say when a retry runs: a failure with attempts
    left is logged as "retry (the server's policy decides when)".
    """
    if not tasks_log.isEnabledFor(logging.INFO):
        return
    ran = item.get("cost_ms", 0) if item else None  # report_item leaves out a cost of 0 ms
    if not applied or item is None:
        _line(attempt, "lost", "lost (its report was refused: taken away, or applied before)", ran)
    elif "stage" in item:
        _line(attempt, "next_stage", f"next stage {item['stage']!r} in {item.get('delay', 0):g}s", ran)
    elif item.get("status") == "success":
        _line(attempt, "success", "success", ran)
    elif item.get("status") == "pending":
        delay = item.get("delay", 0)
        _line(attempt, "snoozed", f"snoozed for {delay:g}s", ran, item.get("error", ""))
    elif item.get("retry") is False or attempt.attempt > attempt.max_retries:
        _line(attempt, "failed", "failed", ran, item.get("error", ""), item.get("detail", ""))
    else:
        words = "retry (the server's policy decides when)"
        _line(attempt, "retry", words, ran, item.get("error", ""), item.get("detail", ""))
