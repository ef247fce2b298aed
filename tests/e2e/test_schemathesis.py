"""Schemathesis against the live server's own `/openapi.json` (127.0.0.1 only, tiny model): every
operation gets a few generated requests; no 5xx, and every status, content type, header and body
the server answers is the one the document promises. Bounded: a few examples per operation, short
completions (`--max-tokens-cap`)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from mlxserve.config import EngineConfig, SecurityConfig, ServerConfig
from mlxserve.server import build_app
from tests.e2e.conftest import SERVED_NAME, start_app

MAX_EXAMPLES = 8  # per operation: the whole run stays well under a minute on the tiny model
# The document's promises. Left out: positive_data_acceptance (a schema-valid body may still name an
# unknown model or ask for more tokens than the context: a documented 400/404) and negative-data
# checks that need every rule (vocabulary ranges, context length) written into the schema.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, unsupported_method]


@pytest.fixture(scope="module")
def live_server(qwen3_model_dir):
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=8, default_max_tokens=8),
                          security=SecurityConfig(max_tokens_cap=16))
    server = start_app(build_app(config))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_api_matches_its_openapi_document(case):
    case.call_and_validate(checks=CHECKS, timeout=60)
