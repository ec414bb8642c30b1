"""Handlers the benchmark measures; they do as little as possible so the engine's cost shows.

This module is also what bench/bench_remote.py's remote workers import, and they run without Django
settings: the `django.tasks` function (which needs them) lives in `django_tasks.py`.
"""

import asyncio
import time

import taskflow


@taskflow.handler("bench.noop")
def noop(ctx):  # noqa: ANN001, ANN201
    return None


@taskflow.handler("bench.async_sleep")
async def async_sleep(ctx):  # noqa: ANN001, ANN201
    """Waits `seconds` (default 1) without a thread: bench/bench_async.py drains thousands of these at once."""
    await asyncio.sleep(ctx.payload.get("seconds", 1.0))
    return None


@taskflow.handler("bench.stamp")
def stamp(ctx):  # noqa: ANN001, ANN201
    """Returns when it started (time.time()): bench/bench_core.py's start latency ends here, as a producer sees it."""
    return {"started": time.time()}
