"""`manage.py check --deploy` on the example project: clean behind HTTPS with one switch (TASKFLOW_HTTPS)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

INSECURE = ["security.W004", "security.W008", "security.W012", "security.W016"]


def check_deploy(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TASKFLOW_", "DATABASE_", "REDIS_"))}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO,
        env={
            **base,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
            "TASKFLOW_VAR_DIR": str(tmp_path),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.processes
def test_check_deploy_is_clean_with_the_https_switch(tmp_path: Path) -> None:
    done = check_deploy(tmp_path, TASKFLOW_HTTPS="1")
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


@pytest.mark.processes
def test_without_the_switch_only_the_https_settings_are_missing(tmp_path: Path) -> None:
    done = check_deploy(tmp_path)
    assert done.returncode == 1
    # Nothing else: the schema's enum names are resolved (drf_spectacular.W001 on `outcome` is gone).
    assert sorted(re.findall(r"\((\S+\.W\d+)\)", done.stderr)) == INSECURE, done.stderr



@pytest.mark.django_db
def test_what_the_swagger_page_links_to_exists() -> None:
    from rest_framework.test import APIClient

    from tests.apiclients import user_with

    client = APIClient()
    client.force_authenticate(user_with("reader"))
    info = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()["info"]
    assert info["license"] == {"name": "MIT"}
    links = re.findall(r"\]\(([^)]+)\)", info["description"])
    links += [info[k]["url"] for k in ("contact", "license", "externalDocs") if "url" in info.get(k, {})]
    links += [info["termsOfService"]] if "termsOfService" in info else []
    # No network here: a link would have to be one of the site's own pages, and answer.
    for link in links:
        assert link.startswith("/"), f"the Swagger page links outside the site: {link}"
        assert client.get(link).status_code == 200, link
