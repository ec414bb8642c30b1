"""django.tasks functions used by tests/test_backend*.py (run by taskflow.backends.TaskflowBackend).

Each run appends "<task id> <attempt> <name>" to TASKFLOW_TEST_LOG, so a test in another process
can see the order tasks ran in.
"""

import asyncio
import os
import threading
import time

from django.dispatch import receiver
from django.tasks import TaskContext, task
from django.tasks.signals import task_enqueued, task_finished, task_started

_lock = threading.Lock()


def note(task_id: str, attempt: int, name: str) -> None:
    path = os.environ.get("TASKFLOW_TEST_LOG")
    if path:
        with _lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{task_id} {attempt} {name} {time.time():.6f}\n".encode())
            finally:
                os.close(fd)


@task()
def noop_task(*args, **kwargs):
    return None


@task()
async def noop_task_async(*args, **kwargs):
    return None


@task()
def calculate_meaning_of_life():
    return 42


@task()
def echo(*args, **kwargs):
    return {"args": list(args), "kwargs": kwargs}


@task()
async def async_echo(*args, **kwargs):
    await asyncio.sleep(0.01)
    return {"args": list(args), "kwargs": kwargs, "async": True}


@task(max_retries=2)
def failing_task_value_error():
    raise ValueError("This task failed due to ValueError")


@task(max_retries=0)
def failing_task_system_exit():
    raise SystemExit("This task failed due to SystemExit")


@task(max_retries=0)
def failing_task_keyboard_interrupt():
    raise KeyboardInterrupt("This task failed due to KeyboardInterrupt")


@task(max_retries=0)
def complex_exception():
    raise ValueError(ValueError("This task failed"))


@task(max_retries=3)
def complex_return_value():
    return {"when": time}  # a module: not JSON


@task(takes_context=True)
def get_task_id(context):
    return context.task_result.id


@task(takes_context=True, max_retries=3)
def flaky_with_context(context, succeed_on):
    """Fails until attempt `succeed_on`; returns what its context said on each attempt."""
    note(context.task_result.id, context.attempt, "flaky")
    if context.attempt < succeed_on:
        raise RuntimeError(f"not yet on attempt {context.attempt}")
    return {"attempt": context.attempt, "worker_ids": context.task_result.worker_ids}


@task(takes_context=True)
def record(context, name):
    note(context.task_result.id, context.attempt, name)
    return name


@task(timeout=1, max_retries=0)
def sleep_for(seconds):
    time.sleep(seconds)


@task(takes_context=True)
def test_context(context, attempt):
    assert isinstance(context, TaskContext)
    assert context.attempt == attempt


@receiver(task_enqueued)
@receiver(task_started)
@receiver(task_finished)
def note_signal(sender, task_result, signal, **kwargs):
    """Each signal as "<id> <attempts> <signal>:<status>:<sender>" (in whichever process sent it)."""
    name = {task_enqueued: "task_enqueued", task_started: "task_started", task_finished: "task_finished"}[signal]
    note(task_result.id, task_result.attempts, f"{name}:{task_result.status}:{sender.__name__}")


@task()
async def async_where(seconds: float = 0.0, *, context_note: str = "") -> dict:
    """Sleeps `seconds` on the worker's loop; returns the thread it ran on and when it started and ended."""
    import threading as _threading

    started = time.time()
    await asyncio.sleep(seconds)
    return {"thread": _threading.current_thread().name, "started": started, "ended": time.time()}


@task(takes_context=True)
async def async_with_context(context: TaskContext) -> int:
    await context.aprogress(1, 2, "half")
    return context.attempt
