import logging

from django.core.management.base import BaseCommand, CommandError

from taskflow.runtime import logs
from taskflow.runtime.stop_signals import run_until_stopped
from taskflow.runtime.watcher import Watcher

log = logging.getLogger("taskflow.watch")


def positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = (
        "Run taskwatch: rescue lost attempts, time out, expire and purge tasks, roll tables (if ROLL_INTERVAL); "
        "one process acts at a time."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument(
            "--interval", type=positive_float, default=None, help="seconds between passes (default WATCH_INTERVAL)"
        )
        parser.add_argument("--once", action="store_true", help="make one pass (if this process can lead), then exit")
        logs.add_arguments(parser)

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        logs.configure(options["loglevel"], verbosity=options["verbosity"], log_format=options["log_format"])
        try:
            watcher = Watcher(interval=options["interval"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        logs.watcher_banner(watcher, once=options["once"])
        if options["once"]:
            counts = watcher.run_once()
            watcher.leadership.resign()
            if counts is None:
                log.info("another taskwatch leads (%s): nothing done", watcher.leadership.holder() or "nobody")
            else:
                log.info("one pass done: %s", ", ".join(f"{name}={n}" for name, n in counts.items()))
            return

        run_until_stopped(watcher.run, watcher.request_stop, name="taskflow-watch")
