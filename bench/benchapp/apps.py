from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "taskflow_bench"

    def ready(self) -> None:
        # Registers django_noop with the taskflow backend in every process with settings (workers
        # and the bench itself); `tasks` is found by taskflow's autodiscovery.
        from bench.benchapp import django_tasks  # noqa: F401
