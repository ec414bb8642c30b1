import os

from django.apps import AppConfig


class TaskAppConfig(AppConfig):
    name = "tests.taskapp"
    label = "taskflow_tests"

    def ready(self) -> None:
        beats = os.environ.get("TASKFLOW_TEST_LIVENESS_DIES_AFTER")
        if beats:
            _kill_liveness_after(int(beats))
        if os.environ.get("TASKFLOW_TEST_KILL_BEFORE_RELEASE"):
            _kill_before_release()


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


def _kill_before_release() -> None:
    """Fault injection for process tests: kill -9 this process when it is about to release dependents.

    The release runs after the finishing transaction committed, so the dependency is finished and
    its dependents still wait: the state a crash there leaves behind.
    """
    import signal

    from taskflow.engine import dependencies

    def release(task_ids, now=None):
        if dependencies.TaskDependency.objects.filter(depends_on_id__in=list(task_ids), outcome="").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return 0

    dependencies.release = release
