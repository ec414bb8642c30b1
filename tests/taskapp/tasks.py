"""Handlers used by the tests. Each run is appended to TASKFLOW_TEST_LOG (one line per run), so
tests in other processes can count exactly how often each task ran."""

import asyncio
import os
import threading
import time

from django.conf import settings

import taskflow

_log_lock = threading.Lock()


def record(ctx, what="run"):
    path = os.environ.get("TASKFLOW_TEST_LOG")
    if path:
        line = f"{ctx.task_id} {ctx.attempt} {what} {ctx.worker_id} {time.time():.6f}\n"
        with _log_lock:
            # O_APPEND writes of one short line are atomic, even across processes.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)


@taskflow.handler("test.noop")
def noop(ctx):
    return None


@taskflow.handler("test.record")
def record_run(ctx):
    record(ctx)
    time.sleep(float(ctx.payload.get("sleep", 0)))
    return {"n": ctx.payload.get("n")}


@taskflow.handler("test.fail")
def always_fail(ctx):
    record(ctx)
    raise RuntimeError(f"boom on attempt {ctx.attempt}")


@taskflow.handler("test.flaky")
def flaky(ctx):
    """Fails until attempt `succeed_on`, then succeeds."""
    record(ctx)
    if ctx.attempt < ctx.payload.get("succeed_on", 2):
        raise ValueError("not yet")
    return {"attempt": ctx.attempt}


@taskflow.handler("test.sleep")
def sleep(ctx):
    """Sleeps `seconds` (default: forever, in short naps) without heartbeating; a `gate` file, once it
    exists, ends the sleep early, so a test can hold tasks running for exactly as long as it needs."""
    record(ctx, "start")
    seconds = ctx.payload.get("seconds")
    gate = ctx.payload.get("gate")
    end = time.monotonic() + (seconds if seconds is not None else 10**9)
    while time.monotonic() < end and not (gate and os.path.exists(gate)):
        time.sleep(0.05)
    record(ctx, "end")
    return {"slept": seconds}


@taskflow.handler("test.heartbeat")
def heartbeat(ctx):
    """Runs `seconds`, calling ctx.heartbeat() every `every` seconds."""
    record(ctx, "start")
    end = time.monotonic() + ctx.payload["seconds"]
    while time.monotonic() < end:
        time.sleep(ctx.payload.get("every", 0.2))
        ctx.heartbeat()
    record(ctx, "end")
    return {"ok": True}


@taskflow.handler("test.control")
def control(ctx):
    """Does what the payload says: snooze, fail, next_stage, checkpoint."""
    record(ctx)
    action = ctx.payload.get("action")
    if action == "snooze" and ctx.checkpoint is None:
        ctx.save_checkpoint("snoozed")
        ctx.snooze(ctx.payload.get("delay", 0))
    if action == "fail":
        ctx.fail("no point retrying")
    if action == "stages" and ctx.stage != "second":
        ctx.next_stage("second", context={"from": ctx.stage or "first"})
    return {"stage": ctx.stage, "context": ctx.context, "checkpoint": ctx.checkpoint}


@taskflow.handler("test.misbehave")
def misbehave(ctx):
    """Does the malformed thing its payload names; otherwise returns a result of `size` bytes of JSON."""
    record(ctx)
    action = ctx.payload.get("action")
    if action == "priority":
        ctx.next_stage("next", priority=500)
    if action == "fail_with_number":
        ctx.fail(404)
    if action == "snooze_forever":
        ctx.snooze(float("inf"))
    if action == "context_not_json":
        ctx.next_stage("next", context={"at": object()})
    if action == "result_not_json":
        return {"ids": {1, 2}}
    if action == "bad_enqueue":
        taskflow.enqueue("test.noop", priority=1000)
    if action == "refused_by_database":
        # Passes every check the worker makes: only the table's CHECK constraint refuses it.
        signal = taskflow.NextStage("next")
        signal.priority = 500
        raise signal
    if action == "exit":
        raise SystemExit(3)
    size = ctx.payload.get("size", 0)
    return {"data": "x" * max(0, size - 12)} if size else {"ok": True}  # '{"data": ""}' is 12 bytes


@taskflow.handler("test.uses_db")
def uses_db(ctx):
    """Reads the database from the handler's own thread; returns its connection's server-side id."""
    from django.db import connection

    record(ctx, "start")
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT CONNECTION_ID()")
        elif connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT 0")
        (backend,) = cursor.fetchone()
    time.sleep(float(ctx.payload.get("sleep", 0)))
    record(ctx, "end")
    return {"backend": backend}


@taskflow.handler("test.until_stopped")
def until_stopped(ctx):
    """Works in short steps until it is told to stop (ctx.stop_requested), at most `seconds`."""
    record(ctx, "start")
    end = time.monotonic() + ctx.payload.get("seconds", 30)
    while time.monotonic() < end:
        if ctx.stop_requested:
            record(ctx, "noticed")
            return {"late": True}  # refused: the attempt was taken away
        time.sleep(0.05)
    record(ctx, "end")
    return {"finished": True}


# The django.tasks functions, found by the worker like handlers. They need Django settings, which a
# remote worker (python -m taskflow.remote) does not have: it imports the handlers above alone.
if settings.configured:
    from . import djtasks  # noqa: F401


@taskflow.handler("test.async_sleep")
async def async_sleep(ctx):
    """Awaits asyncio.sleep(`seconds`) (default: forever), logging its start and its end (or its cancellation)."""
    record(ctx, "start")
    seconds = ctx.payload.get("seconds")
    try:
        await asyncio.sleep(seconds if seconds is not None else 10**9)
    except asyncio.CancelledError:
        record(ctx, "cancelled")
        raise
    record(ctx, "end")
    return {"slept": seconds}


@taskflow.handler("test.async_control")
async def async_control(ctx):
    """test.control's actions, awaited: snooze, fail, next_stage, checkpoint, progress, raise."""
    record(ctx)
    action = ctx.payload.get("action")
    await asyncio.sleep(0)
    if action == "snooze" and ctx.checkpoint is None:
        await ctx.asave_checkpoint("snoozed")
        ctx.snooze(ctx.payload.get("delay", 0))
    if action == "fail":
        ctx.fail("no point retrying")
    if action == "raise":
        raise RuntimeError(f"boom on attempt {ctx.attempt}")
    if action == "stages" and ctx.stage != "second":
        ctx.next_stage("second", context={"from": ctx.stage or "first"})
    if action == "progress":
        await ctx.aprogress(1, 4, "one")
        await ctx.aheartbeat()
        await ctx.aprogress(3, 4, "three")
    if action == "sync_calls":
        # The sync variants, called on the event loop: made in a thread (see TaskContext._write).
        ctx.heartbeat()
        ctx.save_checkpoint({"sync": True})
        ctx.progress(2, 4, "two")
    return {"stage": ctx.stage, "context": ctx.context, "checkpoint": ctx.checkpoint}
