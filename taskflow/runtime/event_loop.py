"""The worker's event loop: one asyncio loop on a thread of its own, where async handlers run.

A coroutine waiting on I/O holds no thread, so one loop runs thousands of async handlers at once;
what they must not do on the loop (a database call: Django refuses it there, and it would block
every other handler) runs on the loop's default executor, a pool of `io_threads` threads, each of
which drops an unusable database connection before it is used (`before_call`), as handler threads do.

Nothing here imports Django: the remote worker runs async handlers too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("taskflow.worker")

_executors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Executor] = weakref.WeakKeyDictionary()


def blocking_executor(loop: asyncio.AbstractEventLoop) -> Executor | None:
    """The I/O thread pool of a worker's event loop (None for a loop that is not a worker's)."""
    return _executors.get(loop)


class _PreparedExecutor(ThreadPoolExecutor):
    """A thread pool that calls `before_call` in the thread before each call (e.g. drop dead connections)."""

    def __init__(self, before_call: Callable[[], None], max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._before_call = before_call

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        def call() -> Any:
            self._before_call()
            return fn(*args, **kwargs)

        return super().submit(call)


class EventLoopThread:
    """An asyncio event loop running on a daemon thread until `stop`."""

    def __init__(self, name: str, *, io_threads: int, before_call: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._executor = _PreparedExecutor(before_call, io_threads, f"{name}-io")
        self.loop.set_default_executor(self._executor)
        _executors[self.loop] = self._executor
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EventLoopThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(
        self, coroutines: Sequence[Coroutine[Any, Any, Any]], started: Callable[[int, asyncio.Task], None]
    ) -> None:
        """Run these coroutines as tasks on the loop; `started(i, task)` is called on the loop as the i-th is created.

        One wake-up of the loop for the lot: a claim of hundreds of attempts is not hundreds of cross-thread calls.
        """

        def create() -> None:
            for i, coroutine in enumerate(coroutines):
                started(i, self.loop.create_task(coroutine))

        self.loop.call_soon_threadsafe(create)

    def cancel(self, task: Callable[[], asyncio.Task | None]) -> None:
        """Cancel the task `task()` returns, on the loop (the callable is read there, after the task is created)."""

        def cancel() -> None:
            running = task()
            if running is not None:
                running.cancel()

        self.loop.call_soon_threadsafe(cancel)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop, let it unwind, and end the thread."""
        if not self._thread.is_alive():
            return

        async def wind_down() -> None:
            tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(wind_down(), self.loop).result(timeout=timeout + 1)
        except Exception as exc:  # noqa: BLE001 - the worker is stopping: say so, and stop regardless
            log.warning("async handlers did not unwind: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.loop.close()
