"""Handlers the benchmark measures; they do as little as possible so the engine's cost shows."""

import asyncio

from django.tasks import task

import taskflow


@taskflow.handler("bench.noop")
def noop(ctx):  # noqa: ANN001, ANN201
    return None


@task()
def django_noop(i):  # noqa: ANN001, ANN201
    """The same do-nothing work as a plain Django task (bench/bench_backend.py)."""
    return None


@taskflow.handler("bench.async_sleep")
async def async_sleep(ctx):  # noqa: ANN001, ANN201
    """Waits `seconds` (default 1) without a thread: bench/bench_async.py drains thousands of these at once."""
    await asyncio.sleep(ctx.payload.get("seconds", 1.0))
    return None
