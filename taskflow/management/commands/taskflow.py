"""`manage.py taskflow <subcommand>`: the operator's command line (docs/cli.md).

Exit status: 0 done; 1 nothing matched, or an operation skipped some tasks (or types); 2 bad
usage or input (one line on stderr, nothing changed).
"""

import argparse
import shlex
import signal
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from taskflow.cli import operating, reading
from taskflow.cli.output import to_json
from taskflow.cli.selection import TaskFilter, add_filter_arguments, integer, moment, task_id
from taskflow.cli.supervisor import Child, Supervisor, manage_command
from taskflow.conf import get_settings
from taskflow.engine import payload_search, registry
from taskflow.exceptions import InvalidTask, UnknownTaskType
from taskflow.models import Task
from taskflow.runtime.django_tasks import select_task_types

OK, PARTIAL, USAGE = 0, 1, 2
STOP_MARGIN = 5.0  # seconds a stopping worker gets beyond its grace to hand back its tasks and exit


class OneLineParser(CommandParser):
    """Bad usage is one line on stderr (not the usage text) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        text = f"{self.prog}: {message} (see --help)"
        if self.called_from_command_line:
            sys.stderr.write(text + "\n")
            sys.exit(USAGE)
        raise CommandError(text, returncode=USAGE)


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more: {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return value


class Command(BaseCommand):
    help = (
        "Operate taskflow: status, list, show, retry, terminate, reschedule, priority, max-retries, pause, resume; "
        "run (workers and the watcher, supervised)."
    )
    exit_status = OK

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.error = OneLineParser.error.__get__(parser)  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        subs = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND", parser_class=OneLineParser)

        def sub(name: str, help: str, json: bool = True) -> argparse.ArgumentParser:  # noqa: A002
            p = subs.add_parser(name, help=help, description=help)
            if json:
                p.add_argument("--json", action="store_true", help="print JSON instead of a table")
            # Django's own options, also after the subcommand (default=SUPPRESS keeps the main parser's values).
            p.add_argument("--settings", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            p.add_argument("--pythonpath", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            return p

        p = sub("status", "per task type: counts by status, in flight, oldest pending, throughput; the workers")
        p.add_argument("--minutes", type=positive_int, default=5, help="throughput over the last N minutes (5)")

        p = sub("list", "list tasks matching the console's filters, newest first")
        add_filter_arguments(p)
        p.add_argument("--limit", type=positive_int, default=50, help="at most this many (50)")
        p.add_argument("--order", choices=reading.ORDERINGS, default="newest", help="newest (default), oldest, due")

        p = sub("show", "one task as its console page shows it")
        p.add_argument("id", type=task_id)

        for name, op in operating.TASK_OPERATIONS.items():
            p = sub(name, op.help)
            add_filter_arguments(p)
            p.add_argument("--all", action="store_true", help="every task (when no id or filter is given)")
            if name == "reschedule":
                when = p.add_mutually_exclusive_group(required=True)
                when.add_argument("--at", type=moment, metavar="WHEN", help="a date and time (local)")
                when.add_argument("--in", dest="delay", type=seconds, metavar="SECONDS", help="seconds from now")
            elif name == "priority":
                p.add_argument("--to", type=integer, required=True, metavar="N", help="-100..100")
            elif name == "max-retries":
                p.add_argument("--to", type=integer, required=True, metavar="N", help="0 or more")
            self.operation_arguments(p)

        for name, op in operating.TYPE_OPERATIONS.items():
            p = sub(name, op.help)
            p.add_argument("types", nargs="+", metavar="TYPE")
            self.operation_arguments(p)

        p = sub("run", "run and supervise N taskworker processes and one taskwatch", json=False)
        p.add_argument("--workers", type=positive_int, default=1, metavar="N", help="taskworker processes (1)")
        p.add_argument("--concurrency", type=positive_int, metavar="N", help="each worker's handler threads")
        p.add_argument("--types", default="", help="each worker's task types (as taskworker --types)")
        p.add_argument("--queues", default="", help="each worker's django.tasks queues (as taskworker --queues)")
        p.add_argument("--grace", type=seconds, help="seconds running tasks get on shutdown (SHUTDOWN_GRACE)")
        p.add_argument("--worker-args", default="", metavar="ARGS", help='more taskworker options, e.g. "--burst"')
        p.add_argument("--watch-args", default="", metavar="ARGS", help='taskwatch options, e.g. "--interval 2"')
        p.add_argument("--no-watch", action="store_true", help="run no taskwatch (another host runs one)")
        p.add_argument("--reload", action="store_true", help="restart every process when a .py file changes")
        p.add_argument(
            "--reload-dir",
            action="append",
            type=Path,
            metavar="DIR",
            help="watch this folder (repeatable; implies --reload; default the project's BASE_DIR)",
        )

    def operation_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="say what would change; change nothing")
        parser.add_argument("--reason", default="", help="recorded in each change's history")
        parser.add_argument("--actor", help='recorded as "cli:ACTOR" (default: the OS user)')

    def run_from_argv(self, argv: list[str]) -> None:
        super().run_from_argv(argv)
        if self.exit_status:
            sys.exit(self.exit_status)

    def handle(self, *args: Any, **options: Any) -> None:
        subcommand = options["subcommand"]
        try:
            if subcommand in operating.TASK_OPERATIONS:
                self.exit_status = self.operate_tasks(operating.TASK_OPERATIONS[subcommand], subcommand, options)
            elif subcommand in operating.TYPE_OPERATIONS:
                op = operating.TYPE_OPERATIONS[subcommand]
                self.exit_status = self.operate(op, options["types"], options, {})
            else:
                self.exit_status = getattr(self, subcommand)(options)
        except InvalidTask as exc:
            raise CommandError(str(exc), returncode=USAGE) from None

    def write(self, options: dict[str, Any], data: Any, text: str) -> None:
        self.stdout.write(to_json(data) if options["json"] else text)

    def status(self, options: dict[str, Any]) -> int:
        report = reading.status(options["minutes"])
        self.write(options, report, reading.status_text(report))
        return OK

    def list(self, options: dict[str, Any]) -> int:
        selection = TaskFilter.from_options(options)
        queryset = selection.queryset()
        rows, more = reading.task_list(queryset, limit=options["limit"], order=options["order"])
        self.write(options, rows, reading.list_text(rows, more))
        if selection.scan_bound is not None:  # on stderr: --json output stays one document
            self.stderr.write(
                f"the payload search read the newest {payload_search.SCAN_LIMIT:,} tasks matching the filters "
                f"(ids from {selection.scan_bound}); filter by type and created time to search older ones"
            )
        return OK if rows else PARTIAL

    def show(self, options: dict[str, Any]) -> int:
        try:
            page = reading.task_page(options["id"])
        except Task.DoesNotExist:
            self.stderr.write(f"no task {options['id']}")
            return PARTIAL
        self.write(options, page, reading.page_text(page))
        return OK

    def run(self, options: dict[str, Any]) -> int:
        types = [t.strip() for t in options["types"].split(",") if t.strip()]
        queues = [q.strip() for q in options["queues"].split(",") if q.strip()]
        try:
            # What each worker would refuse (Worker: a type without a handler, or none at all), refused once here.
            for task_type in select_task_types(types, queues) or registry.registered_types() or [None]:
                if task_type is None:
                    raise ValueError("no task types to work on: register handlers or pass --types")
                registry.get_handler(task_type)
            worker_args = shlex.split(options["worker_args"])
            watch_args = shlex.split(options["watch_args"])
        except (UnknownTaskType, ValueError) as exc:
            raise CommandError(f"run: {exc}", returncode=USAGE) from None
        for name in ("concurrency", "types", "queues", "grace"):
            if options[name]:
                worker_args[:0] = [f"--{name}", str(options[name])]
        if not self._called_from_command_line:
            # The children are started as this process was (manage.py, django-admin, python -m django).
            raise CommandError("run: start it from the command line: manage.py taskflow run", returncode=USAGE)
        workers = range(1, options["workers"] + 1)
        children = [Child(f"worker-{n}", manage_command("taskworker", *worker_args)) for n in workers]
        if not options["no_watch"]:
            children.append(Child("taskwatch", manage_command("taskwatch", *watch_args)))
        reload_dirs = options["reload_dir"] or []
        if options["reload"] and not reload_dirs:
            reload_dirs = [Path(getattr(settings, "BASE_DIR", None) or Path.cwd())]
        grace = options["grace"] if options["grace"] is not None else get_settings().SHUTDOWN_GRACE
        supervisor = Supervisor(children, grace=grace + STOP_MARGIN, say=self.say, reload_dirs=reload_dirs)
        if reload_dirs:
            self.say(f"watching .py files under {', '.join(map(str, reload_dirs))}")
        connections.close_all()  # the children have their own; this one would idle for as long as they run
        signal.signal(signal.SIGTERM, lambda signum, frame: supervisor.request_stop())
        signal.signal(signal.SIGINT, lambda signum, frame: supervisor.request_stop())
        supervisor.run()
        self.say("stopped")
        return OK

    def say(self, message: str) -> None:
        self.stdout.write(f"{datetime.now():%H:%M:%S} taskflow run: {message}")
        self.stdout.flush()

    def operate_tasks(self, op: operating.Operation, name: str, options: dict[str, Any]) -> int:
        selection = TaskFilter.from_options(options)
        if selection.filters_given() or options["all"]:
            target: Any = selection.queryset()
        elif selection.ids:
            target = selection.ids  # by id the engine also reaches tasks rolled into history tables
        else:
            raise CommandError(f"{name}: give task ids, a filter (see --help), or --all", returncode=USAGE)
        value: dict[str, Any] = {}
        if name == "reschedule":
            value["run_after"] = options["at"] if options["at"] is not None else options["delay"]
        elif name == "priority":
            value["priority"] = options["to"]
        elif name == "max-retries":
            value["max_retries"] = options["to"]
        return self.operate(op, target, options, value)

    def operate(self, op: operating.Operation, target: Any, options: dict[str, Any], value: dict[str, Any]) -> int:
        by = operating.actor(options["actor"])
        result = op.function(target, by=by, reason=options["reason"], dry_run=options["dry_run"], **value)
        self.write(options, operating.result_data(result, by, options["reason"]), operating.result_text(result))
        return OK if result.total and not result.skipped else PARTIAL
