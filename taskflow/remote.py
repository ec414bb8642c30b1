"""`python -m taskflow.remote`: run handlers on a machine with no database, through the HTTP API.

    python -m taskflow.remote --url http://host:8000/api/ --token-file /etc/taskflow/token \\
        --handlers myproject.tasks [--types a,b] [--concurrency 8] [--burst]

Needs no Django settings: it imports the handler modules, then runs a RemoteWorker
(taskflow.runtime.remote) until SIGTERM or SIGINT (or, with --burst, until nothing is due).
Exits 0 after a clean stop, 1 if reports could not be delivered, 2 on bad options or a token
the server refuses (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .engine import registry
from .exceptions import UnknownTaskType
from .runtime import logs
from .runtime.remote import RemoteWorker
from .runtime.remote_client import AccessDenied, ApiClient, ApiError
from .runtime.runner import ASYNC_CONCURRENCY, PREFETCH, PREFETCH_WAIT, WorkerFailed
from .runtime.stop_signals import run_until_stopped


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more; got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"must be from 0 to 86400 seconds; got {text}")
    return value


def _api_root(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL; got {text!r}")
    return text if text.endswith("/") else text + "/"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m taskflow.remote", description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, type=_api_root, help="the API root, like http://host:8000/api/")
    parser.add_argument("--token-file", required=True, type=Path, help="a file holding the API token alone")
    parser.add_argument(
        "--handlers",
        required=True,
        action="append",
        help="module(s) registering @taskflow.handler functions (comma-separated or repeated)",
    )
    parser.add_argument("--types", default="", help="comma-separated task types (default: every registered one)")
    parser.add_argument("--concurrency", type=_positive_int, default=8, help="handler threads (default 8)")
    parser.add_argument(
        "--prefetch",
        type=_non_negative_int,
        default=PREFETCH,
        help=f"tasks claimed ahead of free threads, at most ({PREFETCH}); unstarted, they go back uncounted",
    )
    parser.add_argument(
        "--prefetch-wait",
        type=_seconds,
        default=PREFETCH_WAIT,
        help=f"seconds a task claimed ahead may wait for a thread before it is handed back ({PREFETCH_WAIT:g})",
    )
    parser.add_argument(
        "--async-concurrency",
        type=_positive_int,
        default=ASYNC_CONCURRENCY,
        help=f"async handlers run at once on the event loop ({ASYNC_CONCURRENCY})",
    )
    parser.add_argument("--burst", action="store_true", help="exit once nothing is due")
    parser.add_argument("--grace", type=_seconds, default=30.0, help="seconds running tasks get at a stop (30)")
    parser.add_argument("--poll-interval", type=_seconds, default=1.0, help="seconds between holds when idle (1)")
    parser.add_argument("--beat-interval", type=_seconds, default=5.0, help="seconds between liveness beats (5)")
    parser.add_argument(
        "--flush-timeout", type=_seconds, default=60.0, help="seconds to keep sending reports after a stop (60)"
    )
    parser.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for one answer (10)")
    logs.add_arguments(parser, default_level="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The whole process is this worker's: the handlers' own logging shows too, as it did with basicConfig.
    logs.configure(args.loglevel, log_format=args.log_format, logger="")
    try:
        token = args.token_file.read_text().strip()
    except OSError as exc:
        return _fail(f"cannot read the token file: {exc}")
    if not token or len(token.split()) != 1:
        return _fail(f"the token file {args.token_file} must hold the token alone")
    for module in (m.strip() for group in args.handlers for m in group.split(",")):
        if not module:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return _fail(f"cannot import handlers module {module!r}: {exc}")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    try:
        worker = RemoteWorker(
            ApiClient(args.url, token, timeout=args.timeout or 10.0),
            types or registry.registered_types(),
            concurrency=args.concurrency,
            burst=args.burst,
            grace=args.grace,
            poll_interval=args.poll_interval,
            beat_interval=args.beat_interval or 5.0,
            flush_timeout=args.flush_timeout,
            prefetch=args.prefetch,
            prefetch_wait=args.prefetch_wait or PREFETCH_WAIT,
            async_concurrency=args.async_concurrency,
        )
    except (ValueError, UnknownTaskType) as exc:
        return _fail(str(exc))

    try:
        run_until_stopped(worker.run, worker.request_stop, name="taskflow-remote-worker")
    except AccessDenied as exc:
        return _fail(f"the server refused the token ({exc.status}): check the token and its hold_task permission")
    except ApiError as exc:
        return _fail(str(exc))
    except WorkerFailed as exc:
        # One line and a non-zero exit, so a supervisor restarts it (stuck handlers, a dead thread).
        print(f"taskflow.remote: {exc}", file=sys.stderr)
        return 1
    return 1 if worker.lost else 0


def _fail(message: str) -> int:
    print(f"taskflow.remote: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
