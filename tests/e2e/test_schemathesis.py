"""Schemathesis against the live server's own `/openapi.json` (127.0.0.1 only, tiny model): every
operation gets its documented examples and a few generated requests, schema-valid and not; no 5xx, and
every status, content type, header and body the server answers is the one the document promises.
Bounded: a few examples per operation, short completions (`--max-tokens-cap`).

One plain test walks the operations and runs a Hypothesis test per operation, rather than schemathesis's
pytest plugin (`from_fixture` / `parametrize`), whose collection breaks on new pytest releases."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from mlxhost.config import EngineConfig, SecurityConfig, ServerConfig
from mlxhost.server.app import build_app
from tests.e2e.conftest import SERVED_NAME, start_app

MAX_EXAMPLES = 8  # generated per operation: the whole run stays well under a minute on the tiny model
# The document's promises. Left out: positive_data_acceptance (a schema-valid body may still name an
# unknown model or ask for more tokens than the context: a documented 400/404) and negative-data
# checks that need every rule (vocabulary ranges, context length) written into the schema.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, unsupported_method]
SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def live_server(qwen3_model_dir):
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=8, default_max_tokens=8),
                          security=SecurityConfig(max_tokens_cap=16))
    server = start_app(build_app(config))
    yield server
    server.stop()


def _run_cases(strategy: st.SearchStrategy, max_examples: int) -> None:
    """Hypothesis draws cases from the strategy, sends each and validates the answer (shrinking a failure)."""

    @settings(SETTINGS, max_examples=max_examples)
    @given(case=strategy)
    def send_and_validate(case):
        case.call_and_validate(checks=CHECKS, timeout=60)

    send_and_validate()


def test_api_matches_its_openapi_document(live_server):
    schema = schemathesis.openapi.from_url(live_server.url + "/openapi.json")
    operations = [operation for path in schema for operation in schema[path].values()]
    assert len(operations) >= 10, [operation.label for operation in operations]
    failures = []
    for operation in operations:
        generated = st.one_of([operation.as_strategy(generation_mode=mode) for mode in schemathesis.GenerationMode])
        try:
            for example in operation.get_strategies_from_examples():
                _run_cases(example, max_examples=1)
            _run_cases(generated, max_examples=MAX_EXAMPLES)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # schemathesis raises a case's failures as a BaseExceptionGroup
            failures.append(f"{operation.label}: {type(exc).__name__}: {exc}")  # every operation still runs
    assert not failures, "\n\n".join(failures)
