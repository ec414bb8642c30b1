"""Summaries of py-spy's raw (collapsed-stack) output: where a worker process spends its time."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")


@dataclass(frozen=True)
class Frame:
    func: str
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.func} ({_short(self.path)}:{self.line})"

    @property
    def in_worker(self) -> bool:
        # taskflow code other than module imports and the command's start-up.
        return "taskflow/" in self.path and self.func != "<module>" and "management/commands" not in self.path


Stack = tuple[list[Frame], int]

# Buckets reported as a share of the worker's GIL samples; a sample counts in every bucket one of
# its frames matches (inclusive), so the shares overlap and need not add up to 100%.
CATEGORIES: list[tuple[str, str, str]] = [
    ("claim loop round (DatabaseConnector._claim_round)", "taskflow/runtime/worker.py", "_claim_round"),
    ("  claim_batch (taskflow/engine/claiming.py)", "taskflow/engine/claiming.py", "claim_batch"),
    ("reporter flush (DatabaseConnector.report)", "taskflow/runtime/worker.py", "report"),
    ("  finish_attempts (taskflow/engine/finishing.py)", "taskflow/engine/finishing.py", "finish_attempts"),
    ("    row_changes", "taskflow/engine/transitions.py", "row_changes"),
    ("    update_attempts (SQL build + run)", "taskflow/engine/sql.py", "update_attempts"),
    ("handler dispatch (Runner.execute)", "taskflow/runtime/runner.py", "execute"),
    ("  json_text (result check)", "taskflow/engine/validation.py", "json_text"),
    ("config cache (configs.get_many)", "taskflow/engine/configs.py", "get_many"),
    ("liveness heartbeat thread", "taskflow/runtime/liveness.py", ""),
    ("wake-up listener thread", "taskflow/engine/wakeup.py", ""),
    ("JSON encode/decode (json/)", "/json/", ""),
    ("Django ORM query building + model code (django/db/models/)", "django/db/models/", ""),
    ("Django transaction/connection handling", "django/db/transaction.py", ""),
    ("DB cursor execute, Python side (Django wrapper + driver)", "", "execute"),
]

# Threads of a worker process, recognised by a function on their stack.
ROLES: list[tuple[str, str]] = [
    ("claim loop (main thread)", "Runner._claim_step"),
    ("reporter thread", "Runner._report_step"),
    ("handler threads (all of them)", "Runner._handler_step"),
    ("liveness thread", "LivenessBeat._beat_and_wait"),
    ("wake-up listener thread", "RedisListener.listen"),
]


def parse(path: Path) -> list[Stack]:
    """The stacks in a py-spy raw file, root first, with their sample counts."""
    stacks = []
    for text in path.read_text(errors="replace").splitlines():
        stack, _, count = text.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for part in stack.split(";"):
            match = _FRAME.match(part)
            if match:
                frames.append(Frame(match["func"], match["path"], int(match["line"] or 0)))
            else:
                frames.append(Frame(part, "", 0))
        stacks.append((frames, int(count)))
    return stacks


def summarise_cpu(path: Path, top: int = 12) -> str:
    """For a `py-spy --gil` profile: category shares, hottest taskflow functions, hottest leaves."""
    stacks = parse(path)
    # Only stacks that run the worker count; imports and Django start-up are a fixed cost per process.
    busy = [(frames, n) for frames, n in stacks if any(f.in_worker for f in frames)]
    total = sum(n for _, n in busy)
    if not total:
        return f"no worker samples in {path}"
    rest = sum(n for _, n in stacks) - total
    header = f"{total} GIL samples in the running worker ({rest} more in start-up, not counted)"
    return "\n".join([header, *_shares(busy, total, CATEGORIES, top, lambda f: f.in_worker)])


def _shares(
    stacks: list[Stack],
    total: int,
    categories: list[tuple[str, str, str]],
    top: int,
    ours: Callable[[Frame], bool],
) -> list[str]:
    """Category shares of `total` samples, then the hottest of our functions (inclusive) and leaves."""
    lines = ["category shares:"]
    for label, path_part, func in categories:
        count = sum(n for frames, n in stacks if any(_matches(f, path_part, func) for f in frames))
        lines.append(f"  {100 * count / total:5.1f}%  {label}")
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for frames, n in stacks:
        for name in {f"{f.func} ({_short(f.path)})" for f in frames if ours(f)}:
            inclusive[name] += n
        leaf[f"{frames[-1].func} ({_short(frames[-1].path)})"] += n
    lines.append(f"top {top} taskflow functions (inclusive):")
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    lines.append(f"top {top} leaf functions (self time, any code):")
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in leaf.most_common(top)]
    return lines


def summarise_wall(path: Path, top: int = 6) -> str:
    """For a `py-spy --idle` profile: per worker thread, where its wall-clock time goes.

    Each sample is labelled with the deepest taskflow frame and the innermost frame under it, e.g.
    "claim_batch (claiming.py:120) -> Connection.query", so waits on the database, on events and on
    the GIL-holding Python code can be told apart.
    """
    stacks = parse(path)
    lines = []
    for label, marker in ROLES:
        role = [(frames, n) for frames, n in stacks if any(f.func == marker for f in frames)]
        total = sum(n for _, n in role)
        if not total:
            continue
        spots: Counter[str] = Counter()
        for frames, n in role:
            spots[_wall_label(frames)] += n
        lines.append(f"{label}: {total} samples")
        lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in spots.most_common(top)]
    return "\n".join(lines) or f"no worker samples in {path}"


def _wall_label(frames: list[Frame]) -> str:
    ours = [i for i, f in enumerate(frames) if f.in_worker]
    if not ours:
        return frames[-1].where
    deepest = frames[ours[-1]]
    leaf = frames[-1]
    if leaf is deepest:
        return deepest.where
    return f"{deepest.where} -> {leaf.func} ({_short(leaf.path)})"


def _matches(frame: Frame, path_part: str, func: str) -> bool:
    if path_part and path_part not in frame.path:
        return False
    if func == "execute" and not path_part:
        # The database round trip: the driver call under Django's cursor wrapper.
        path = frame.path
        driver = "MySQLdb" in path or "psycopg" in path or "django/db/backends/" in path
        return driver and frame.func.rpartition(".")[2] in {"execute", "executemany", "query", "_query"}
    return not func or frame.func.endswith(func)


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3", f"{_ROOT}/"):
        if marker in path:
            return path.split(marker, 1)[1].lstrip("/0123456789.")
    return path


# Buckets of an API server process's GIL samples (bench_remote.py --py-spy), inclusive as above.
SERVER_CATEGORIES: list[tuple[str, str, str]] = [
    ("a request in Django (WSGIHandler.__call__)", "django/core/handlers/wsgi.py", "__call__"),
    ("  middleware before and after the view", "django/middleware/", ""),
    ("  DRF authentication (perform_authentication)", "rest_framework/views.py", "perform_authentication"),
    ("  DRF permission checks (check_permissions)", "rest_framework/views.py", "check_permissions"),
    ("  DRF content negotiation", "rest_framework/negotiation.py", ""),
    ("  request body parsing (BoundedJSONParser)", "taskflow/api/parsers.py", ""),
    ("  serializer validation (run_validation)", "rest_framework/", "run_validation"),
    ("  answer serialization (to_representation)", "", "to_representation"),
    ("  JSON rendering (JSONRenderer.render)", "rest_framework/renderers.py", "render"),
    ("  hold (engine/remote.py hold)", "taskflow/engine/remote.py", "hold"),
    ("  reports (engine/remote.py finish)", "taskflow/engine/remote.py", "finish"),
    ("  remote worker liveness (_register)", "taskflow/engine/remote.py", "_register"),
    ("  attempt keys (HMAC)", "taskflow/engine/remote.py", "attempt_key"),
    ("  create (taskflow.enqueue)", "taskflow/engine/enqueueing.py", "enqueue_many"),
    ("Django ORM query building + model code (django/db/models/)", "django/db/models/", ""),
    ("DB cursor execute, Python side (Django wrapper + driver)", "", "execute"),
    ("gunicorn (accepting, reading, writing)", "gunicorn/", ""),
]


def summarise_server(path: Path, top: int = 15) -> str:
    """For a `py-spy --gil` profile of an API server process: where its CPU goes, by category and function."""
    stacks = parse(path)
    total = sum(n for _, n in stacks)
    if not total:
        return f"no samples in {path}"
    return "\n".join([f"{total} GIL samples", *_shares(stacks, total, SERVER_CATEGORIES, top, _in_taskflow)])


def _in_taskflow(frame: Frame) -> bool:
    return "taskflow/" in frame.path
