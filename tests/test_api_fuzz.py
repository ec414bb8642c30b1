"""Schemathesis against the API's own OpenAPI schema, on a live server and a real database.

Every operation gets FUZZ_EXAMPLES generated requests (valid and invalid ones) from a user holding
every permission; any 5xx, an undocumented status code or a body that breaks the schema fails.
Bounded: FUZZ_EXAMPLES per operation, no shrinking, about a minute in all. Marked `fuzz` (CI runs
it on the SQLite leg only).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import requests
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, Phase, settings
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

import taskflow
from tests.apiclients import ROLES, user_with

FUZZ_EXAMPLES = int(os.environ.get("TASKFLOW_FUZZ_EXAMPLES", "25"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]

pytestmark = pytest.mark.fuzz


@pytest.fixture
def fuzz_headers(transactional_db) -> dict[str, str]:  # noqa: ANN001
    """A token of a user with every permission, and a few tasks for the read endpoints to find."""
    user = user_with("fuzzer", *ROLES["everything"])
    taskflow.enqueue_many([{"task_type": "fuzz.job", "key": f"k{i}", "payload": {"i": i}} for i in range(5)])
    return {"Authorization": f"Token {Token.objects.create(user=user).key}"}


def generated_schema() -> dict:
    """The schema /api/schema/ serves (generated here: pytest collects before any server runs)."""
    generator = SchemaGenerator()
    return json.loads(json.dumps(generator.get_schema(request=None, public=True), default=str))


schema = schemathesis.openapi.from_dict(generated_schema())
if importlib.util.find_spec("taskflow.engine.stats") is None:
    # GET /api/stats/ serves the dashboard's module; until that is merged there is nothing to test.
    schema = schema.exclude(path="/api/stats/")


def test_the_schema_served_is_the_one_fuzzed(live_server, fuzz_headers: dict[str, str]) -> None:  # noqa: ANN001
    served = requests.get(f"{live_server.url}/api/schema/", headers=fuzz_headers, timeout=30)
    assert served.status_code == 200 and served.json() == generated_schema()


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_the_api_answers_every_generated_request_as_its_schema_says(
    case,  # noqa: ANN001
    live_server,  # noqa: ANN001
    fuzz_headers: dict[str, str],
) -> None:
    case.call_and_validate(base_url=live_server.url, headers=fuzz_headers, checks=CHECKS)
