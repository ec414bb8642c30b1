"""Log records about a task carry its task id and trace id (engine/tasklog.py), from a real worker."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings

import taskflow
from taskflow.engine import tasklog
from taskflow.models import Status, Task
from taskflow.runtime.worker import Worker

from .conftest import run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

handler_log = logging.getLogger("tests.tasklog.handler")


@taskflow.handler("test_tasklog.talks")
def talks(ctx: Any) -> None:
    handler_log.warning("working on %s", ctx.payload["n"])


@taskflow.handler("test_tasklog.fails")
def fails(ctx: Any) -> None:
    handler_log.error("about to fail")
    raise RuntimeError("no")


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(tasklog.TaskLogFilter())
        # The example project's own format, so a renamed attribute breaks this test.
        self.setFormatter(logging.Formatter(settings.LOGGING["formatters"]["plain"]["format"]))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.format(record))


@pytest.fixture
def collected() -> Iterator[Collect]:
    collect = Collect()
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(collect)
    yield collect
    root.removeHandler(collect)
    root.setLevel(old_level)


def run_burst(*task_types: str) -> None:
    worker = Worker(list(task_types), concurrency=2, burst=True, grace=1)
    thread, raised = run_in_thread(worker)
    thread.join(timeout=60)
    assert not thread.is_alive() and not raised


def test_records_logged_while_a_handler_runs_name_its_task_and_trace(collected: Collect) -> None:
    one = taskflow.enqueue("test_tasklog.talks", {"n": 1}, trace_id="trace-one")
    two = taskflow.enqueue("test_tasklog.talks", {"n": 2})  # given a fresh trace id by enqueue

    handler_log.warning("before any task")
    run_burst("test_tasklog.talks")

    mine = {r.getMessage(): r for r in collected.records if r.name == handler_log.name}
    assert (mine["working on 1"].task_id, mine["working on 1"].trace_id) == (one.pk, "trace-one")
    assert (mine["working on 2"].task_id, mine["working on 2"].trace_id) == (two.pk, two.trace_id)
    assert two.trace_id
    assert (mine["before any task"].task_id, mine["before any task"].trace_id) == ("-", "-")
    assert any(line.endswith(f"task={one.pk} trace=trace-one working on 1") for line in collected.lines)
    # The worker's own lines outside any handler (start, stop) are about no task.
    started = [r for r in collected.records if r.name == "taskflow.worker" and "starting" in r.getMessage()]
    assert started and started[0].task_id == "-"
    assert tasklog.current() is None


def test_a_failing_handler_s_records_and_the_engine_s_lines_about_one_task_carry_it(collected: Collect) -> None:
    failing = taskflow.enqueue("test_tasklog.fails", trace_id="trace-f", max_retries=0)
    run_burst("test_tasklog.fails")
    assert Task.objects.get(pk=failing.pk).status == Status.FAILED
    (record,) = [r for r in collected.records if r.getMessage() == "about to fail"]
    assert (record.task_id, record.trace_id) == (failing.pk, "trace-f")

    # A line the engine logs about one task outside its handler passes it as `extra`, which wins.
    class Row:
        id, trace_id = 42, "t-42"

    with tasklog.running(Row()):
        logging.getLogger("taskflow.finishing").warning("inside 42")
    logging.getLogger("taskflow.finishing").warning("about 7", extra=tasklog.about(failing))
    by_message = {r.getMessage(): r for r in collected.records}
    assert (by_message["inside 42"].task_id, by_message["inside 42"].trace_id) == (42, "t-42")
    assert (by_message["about 7"].task_id, by_message["about 7"].trace_id) == (failing.pk, "trace-f")
