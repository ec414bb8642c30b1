from django.core.management.base import BaseCommand, CommandError

from taskflow.exceptions import UnknownTaskType
from taskflow.runtime import logs
from taskflow.runtime.django_tasks import select_task_types
from taskflow.runtime.stop_signals import run_until_stopped
from taskflow.runtime.worker import Worker, WorkerFailed


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(value)
    return number


def non_negative_float(value: str) -> float:
    number = float(value)
    if number < 0:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = "Run a taskflow worker: claim due tasks and run their handlers until stopped."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--concurrency", type=positive_int, default=8, help="handler threads (default 8)")
        parser.add_argument(
            "--types",
            default="",
            help="comma-separated task types and django.tasks module paths (default: all registered and all @task)",
        )
        parser.add_argument(
            "--queues", default="", help="comma-separated django.tasks queue names (default: those TASKS allows)"
        )
        parser.add_argument(
            "--prefetch",
            type=non_negative_int,
            default=None,
            help="tasks claimed ahead of free threads, at most (default: TASKFLOW['PREFETCH'], 256; 0: none)",
        )
        parser.add_argument(
            "--async-concurrency",
            type=positive_int,
            default=None,
            help="async handlers run at once on the event loop (default: TASKFLOW['ASYNC_CONCURRENCY'], 1000)",
        )
        parser.add_argument("--burst", action="store_true", help="drain what is due, then exit")
        parser.add_argument(
            "--grace", type=non_negative_float, default=None, help="seconds running tasks get to finish on shutdown"
        )
        logs.add_arguments(parser)

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        logs.configure(options["loglevel"], verbosity=options["verbosity"], log_format=options["log_format"])
        types = [t.strip() for t in options["types"].split(",") if t.strip()]
        queues = [q.strip() for q in options["queues"].split(",") if q.strip()]
        try:
            worker = Worker(
                select_task_types(types, queues),
                concurrency=options["concurrency"],
                burst=options["burst"],
                grace=options["grace"],
                prefetch=options["prefetch"],
                async_concurrency=options["async_concurrency"],
                # Asked again as it runs: a queue first used later (QUEUES: []) is served within moments.
                select_types=lambda: select_task_types(types, queues),
            )
        except (UnknownTaskType, ValueError) as exc:  # InvalidTask too: a queue name no task type can hold
            raise CommandError(str(exc)) from None

        try:
            run_until_stopped(worker.run, worker.request_stop, name="taskflow-worker")
        except WorkerFailed as exc:
            # Exit non-zero with one line, so a supervisor restarts a worker that cannot go on (a
            # thread died or kept failing, or stuck handlers clog it); taskwatch rescues its tasks.
            raise CommandError(str(exc)) from None
