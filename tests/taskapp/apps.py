import os

from django.apps import AppConfig


class TaskAppConfig(AppConfig):
    name = "tests.taskapp"
    label = "taskflow_tests"

    def ready(self) -> None:
        beats = os.environ.get("TASKFLOW_TEST_LIVENESS_DIES_AFTER")
        if beats:
            _kill_liveness_after(int(beats))


def _kill_liveness_after(beats: int) -> None:
    """Fault injection for process tests: the liveness thread dies after this many beats."""
    from taskflow.engine import workers

    real, done = workers.beat, []

    def beat(*args, **kwargs):
        if len(done) >= beats:
            raise SystemExit("injected: the liveness thread dies")
        done.append(1)
        return real(*args, **kwargs)

    workers.beat = beat
