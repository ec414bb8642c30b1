"""The package's own metadata: one version, one license, type information shipped."""

from __future__ import annotations

import tomllib

import taskflow
from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_version_is_pyprojects() -> None:
    assert taskflow.__version__ == PYPROJECT["version"]
    assert "__version__" in taskflow.__all__


def test_license_is_the_same_in_license_and_pyproject() -> None:
    assert PYPROJECT["license"] == "MIT"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")


def test_changelog_names_the_unreleased_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and PYPROJECT["version"] in text


def test_type_information_ships_with_the_app() -> None:
    assert (REPO / "taskflow" / "py.typed").is_file()
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["taskflow"]
