import subprocess

import pytest

import taskflow
from taskflow.models import Status, Task

from .conftest import read_runs, wait_until


@pytest.mark.django_db(transaction=True)
def test_enqueue_and_run_in_process():
    from taskflow.runtime.worker import Worker

    task = taskflow.enqueue("test.noop", {"x": 1})
    Worker(["test.noop"], concurrency=2, burst=True).run()
    task.refresh_from_db()
    assert task.status == Status.SUCCESS


@pytest.mark.processes
def test_worker_process_runs_a_task(spawn, run_log):
    task = taskflow.enqueue("test.record", {"n": 7})
    proc = spawn("taskworker", "--types", "test.record", "--burst")
    assert proc.wait(timeout=60) == 0, open(proc.log_path).read()
    assert Task.objects.get(pk=task.pk).result == {"n": 7}
    assert [r[0] for r in read_runs(run_log)] == [str(task.pk)]
    _ = (subprocess, wait_until)
