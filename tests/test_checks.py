"""System checks: `manage.py check` names each bad TASKFLOW value, a missing Redis cache and non-IMMEDIATE SQLite."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from taskflow.checks import check_settings
from taskflow.conf import get_settings

from .conftest import REPO, database_url


def errors_with(taskflow: Any) -> list[tuple[str, str]]:
    with override_settings(TASKFLOW=taskflow):
        return [(e.id, e.msg) for e in check_settings()]


def ids_with(**values: Any) -> list[str]:
    return [id_ for id_, _ in errors_with({**settings.TASKFLOW, **values})]


def test_the_test_settings_pass() -> None:
    assert check_settings() == []
    assert errors_with(None) == [] and errors_with({}) == []


@pytest.mark.parametrize(
    ("key", "value", "error_id"),
    [
        ("SCHEDULE_INTERVAL", "fast", "taskflow.E003"),
        ("SCHEDULE_INTERVAL", 0, "taskflow.E004"),
        ("SCHEDULE_INTERVAL", math.nan, "taskflow.E004"),
        ("CONFIG_REFRESH", "1", "taskflow.E003"),
        ("MAX_PAYLOAD_BYTES", 0, "taskflow.E004"),
        ("MAX_PAYLOAD_BYTES", 1.5e6, "taskflow.E003"),
        ("SCHEDULE_LIMIT", 0, "taskflow.E004"),
        ("SCHEDULE_LIMIT", 1001, "taskflow.E004"),
        ("MAX_PROCESSING_TIME", 0, "taskflow.E004"),
        ("RETRY_STRATEGY", "linear", "taskflow.E004"),
        ("RETRY_JITTER", 1.5, "taskflow.E004"),
        ("PRIORITY_AGING", -1, "taskflow.E004"),
        ("LEADER_TTL", math.inf, "taskflow.E004"),
        ("PURGE_BATCH", 0, "taskflow.E004"),
        ("REDIS_NAMESPACE", "", "taskflow.E004"),
        ("REDIS_NAMESPACE", "a:b", "taskflow.E004"),
        ("REDIS_ALIAS", 0, "taskflow.E003"),
    ],
)
def test_a_bad_value_is_an_error_naming_its_key_and_why(key: str, value: Any, error_id: str) -> None:
    [(found_id, message)] = errors_with({**settings.TASKFLOW, key: value})
    assert found_id == error_id
    assert message.startswith(f"TASKFLOW[{key!r}] must be") and repr(value) in message


def test_unknown_keys_and_a_setting_that_is_not_a_dict_are_errors() -> None:
    assert errors_with({"SCHEDULE_INTERVALS": 1.0}) == [
        ("taskflow.E002", "TASKFLOW['SCHEDULE_INTERVALS'] is not a taskflow setting")
    ]
    # A removed setting says why it went: a node number in the settings is shared by every process.
    [(found_id, message)] = errors_with({"NODE_ID": 3})
    assert found_id == "taskflow.E002" and "no longer supported" in message and "same ids" in message
    assert errors_with([("SCHEDULE_INTERVAL", 1.0)]) == [("taskflow.E001", "TASKFLOW must be a dict; got list")]


def test_every_bad_key_is_reported_at_once() -> None:
    found = errors_with({"SCHEDULE_LIMIT": 0, "RETRY_JITTER": "a little", "TYPO": 1})
    assert [id_ for id_, _ in found] == ["taskflow.E002", "taskflow.E004", "taskflow.E003"]


def test_settings_that_contradict_each_other_are_errors() -> None:
    assert ids_with(RETRY_INTERVAL=600.0, MAX_RETRY_INTERVAL=60.0) == ["taskflow.E005"]
    [(_, message)] = errors_with({"HEARTBEAT_INTERVAL": 5.0, "LIVENESS_TIMEOUT": 6.0})
    assert "LIVENESS_TIMEOUT" in message and "run a second time" in message
    # Reported beside unrelated errors, but not for a pair one of whose values is itself wrong.
    assert [i for i, _ in errors_with({"TYPO": 1, "HEARTBEAT_INTERVAL": 5.0, "LIVENESS_TIMEOUT": 6.0})] == [
        "taskflow.E002",
        "taskflow.E005",
    ]
    assert [i for i, _ in errors_with({"HEARTBEAT_INTERVAL": 20.0, "LIVENESS_TIMEOUT": "30"})] == ["taskflow.E003"]


def test_redis_alias_must_name_a_configured_django_redis_cache() -> None:
    caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    with override_settings(CACHES=caches):
        [(missing, message)] = errors_with({"REDIS_ALIAS": "redis"})
        assert missing == "taskflow.E006" and "'redis'" in message and "'default'" in message
        assert ids_with(REDIS_ALIAS="default") == ["taskflow.E007"]


def test_get_settings_refuses_a_bad_value_with_the_same_message() -> None:
    refused = pytest.raises(ImproperlyConfigured, match=r"TASKFLOW\['MAX_PROCESSING_TIME'\] must be from 1 to")
    with override_settings(TASKFLOW={"MAX_PROCESSING_TIME": 0}), refused:
        get_settings()
    assert get_settings().MAX_PROCESSING_TIME == 300  # the test settings again


# -- manage.py check, as a real process ---------------------------------------------------------------


def manage_py_check(tmp_path: Path, settings_body: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `manage.py check` on tests.settings plus `settings_body`; returns its exit code and output."""
    package = tmp_path / "checksettings"
    package.mkdir(exist_ok=True)
    (package / "check_settings.py").write_text(
        "from tests.settings import *  # noqa\nfrom tests.settings import DATABASES, TASKFLOW  # noqa\n" + settings_body
    )
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": str(package), "DJANGO_SETTINGS_MODULE": "check_settings"}
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "check"],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.django_db(transaction=True)  # no transaction left open: the check reads the database
def test_manage_py_check_passes_on_the_test_settings(tmp_path: Path) -> None:
    code, output = manage_py_check(tmp_path, "", {"DATABASE_URL": database_url()})
    assert code == 0, output
    assert "no issues" in output


def test_manage_py_check_names_each_bad_taskflow_value_and_fails(tmp_path: Path) -> None:
    code, output = manage_py_check(
        tmp_path,
        "TASKFLOW = {**TASKFLOW, 'SCHEDULE_INTERVAL': 'fast', 'MAX_PAYLOAD_BYTES': 0, 'NOT_A_SETTING': 1}\n"
        # No database access: the checks read the settings only.
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:',"
        " 'OPTIONS': {'transaction_mode': 'IMMEDIATE'}}}\n",
    )
    assert code != 0
    assert "(taskflow.E003) TASKFLOW['SCHEDULE_INTERVAL'] must be a number; got 'fast' (str)" in output
    assert "(taskflow.E004) TASKFLOW['MAX_PAYLOAD_BYTES'] must be from 1024 to" in output
    assert "(taskflow.E002) TASKFLOW['NOT_A_SETTING'] is not a taskflow setting" in output
    assert "Traceback" not in output


@pytest.mark.parametrize("options", ["{}", "{'transaction_mode': 'DEFERRED'}"])
def test_manage_py_check_refuses_sqlite_without_immediate_transactions(tmp_path: Path, options: str) -> None:
    sqlite = f"{{'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:', 'OPTIONS': {options}}}"
    code, output = manage_py_check(tmp_path, f"DATABASES = {{'default': {sqlite}}}\n")
    assert code != 0
    assert "(taskflow.E008) DATABASES['default'] is SQLite with transaction_mode DEFERRED" in output
    assert "database is locked" in output and "transaction_mode'] = 'IMMEDIATE'" in output
