"""Test settings: the project's settings with the engine's timings shortened."""

import faulthandler
import json
import os
import signal

os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-tests-only")

from project.settings import *  # noqa: E402,F403
from project.settings import INSTALLED_APPS, TASKFLOW  # noqa: E402

# A host project as a user has it: Django's own admin (the example project titles its site; the
# tests check that installing taskflow leaves a project's admin titled as Django's).
INSTALLED_APPS = [
    "django.contrib.admin" if app == "project.admin.ExampleAdminConfig" else app for app in INSTALLED_APPS
] + ["tests.taskapp"]

TASKFLOW = {
    **TASKFLOW,
    "SCHEDULE_INTERVAL": 0.2,
    "CONFIG_REFRESH": 0.2,
    "RETRY_INTERVAL": 0.1,
    "MAX_RETRY_INTERVAL": 1.0,
    "HEARTBEAT_INTERVAL": 0.5,
    "LIVENESS_TIMEOUT": 3.0,
    "SHUTDOWN_GRACE": 5.0,
    "RECONCILE_INTERVAL": 1.0,
    "WATCH_INTERVAL": 0.5,
    "LEADER_TTL": 2.0,
}
# Process tests hand their child processes extra TASKFLOW values (rolling's limits, say) as JSON.
TASKFLOW.update(json.loads(os.environ.get("TASKFLOW_TEST_OVERRIDES", "{}")))
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Two queues, so the django.tasks backend's queue selection is exercised (tests/test_backend*.py).
TASKS = {"default": {"BACKEND": "taskflow.backends.TaskflowBackend", "QUEUES": ["default", "other"]}}

# A test whose child process will not exit sends it SIGUSR1 for every thread's stack in its log
# (tests/conftest.py: exit_status), so a hang in CI says where it hung.
faulthandler.register(signal.SIGUSR1, all_threads=True)
