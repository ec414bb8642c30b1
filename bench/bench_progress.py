#!/usr/bin/env python
"""What ctx.progress() costs a hot loop: time per call and rows written, against the same loop without it.

No database: the attempt's channel counts its writes and sleeps --write-ms for each (a heartbeat
UPDATE's round trip), so the figures are the throttle's own cost plus the writes it lets through.
Run from the repository root:
  .venv/bin/python bench/bench_progress.py                 # 1,000,000 calls, 5 runs
  .venv/bin/python bench/bench_progress.py --calls 100000 --runs 3 --write-ms 5
It prints medians of --runs alternating runs (with and without progress), never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from taskflow.engine.progress import Progress  # noqa: E402
from taskflow.runtime.context import TaskContext  # noqa: E402


@dataclass
class Attempt:
    id: int = 1
    task_type: str = "bench.progress"
    key: str | None = None
    version: int = 0
    priority: int = 0
    payload: Any = None
    attempt: int = 1
    max_retries: int = 3
    stage: str = ""
    context: Any = None
    checkpoint: Any = None
    trace_id: str = ""
    worker_id: str = "bench:1:w"


class SleepingChannel:
    """An attempt channel whose every write takes `write_s` (a database round trip), counted."""

    def __init__(self, write_s: float) -> None:
        self.write_s, self.writes = write_s, 0

    @property
    def deadline(self) -> datetime:
        return datetime.now(UTC)

    @property
    def stop_requested(self) -> bool:
        return False

    def heartbeat(self, checkpoint: Any = ..., progress: Progress | None = None) -> datetime:
        self.writes += 1
        time.sleep(self.write_s)
        return self.deadline


def loop(calls: int, report: bool, write_s: float) -> tuple[float, int]:
    channel = SleepingChannel(write_s)
    ctx = TaskContext(Attempt(), channel)

    def handler(ctx: TaskContext) -> int:
        total = 0
        for i in range(1, calls + 1):
            total += i & 7  # the loop's own "work"
            if report:
                ctx.progress(i, calls, "rows")
        return total

    started = time.perf_counter()
    ctx.run(handler)
    return time.perf_counter() - started, channel.writes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--write-ms", type=float, default=2.0, help="time each write takes (default 2 ms)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 100,000 calls, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.runs = min(args.calls, 100_000), 1
    with_progress, without, writes = [], [], []
    for _ in range(args.runs):  # alternating, so a busy moment hits both alike
        seconds, n = loop(args.calls, True, args.write_ms / 1000)
        with_progress.append(seconds)
        writes.append(n)
        without.append(loop(args.calls, False, args.write_ms / 1000)[0])
    a, b = statistics.median(with_progress), statistics.median(without)
    print(f"{args.calls:,} iterations, median of {args.runs} runs, writes taking {args.write_ms} ms")
    print(f"  loop without progress: {b:.3f} s")
    print(f"  loop with progress:    {a:.3f} s  ({(a - b) / args.calls * 1e9:.0f} ns per call)")
    print(f"  rows written:          {statistics.median(writes):.0f} (min {min(writes)}, max {max(writes)})")


if __name__ == "__main__":
    main()
