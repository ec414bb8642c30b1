"""Benchmark settings: the project's settings plus the app that registers the bench handlers."""

import os

os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from project.settings import *  # noqa: E402,F403
from project.settings import INSTALLED_APPS  # noqa: E402

INSTALLED_APPS = [*INSTALLED_APPS, "bench.benchapp"]
# TASKFLOW is deliberately left as the project sets it (engine defaults plus REDIS_ALIAS), so the
# figures describe what a deployment gets out of the box.
