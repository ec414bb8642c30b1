"""The benchmark's `django.tasks` function (bench/bench_backend.py); `@task()` needs Django settings."""

from django.tasks import task


@task()
def django_noop(i):  # noqa: ANN001, ANN201
    """The same do-nothing work as `bench.noop`, as a plain Django task."""
    return None
