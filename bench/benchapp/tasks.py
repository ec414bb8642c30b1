"""Handlers the benchmark measures; they do as little as possible so the engine's cost shows."""

import taskflow


@taskflow.handler("bench.noop")
def noop(ctx):  # noqa: ANN001, ANN201
    return None
