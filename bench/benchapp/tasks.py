"""Handlers the benchmark measures; they do as little as possible so the engine's cost shows."""

from django.tasks import task

import taskflow


@taskflow.handler("bench.noop")
def noop(ctx):  # noqa: ANN001, ANN201
    return None


@task()
def django_noop(i):  # noqa: ANN001, ANN201
    """The same do-nothing work as a plain Django task (bench/bench_backend.py)."""
    return None
