"""A request's prefill progress as /v1/status lists it and the debug log says it. No model."""

from __future__ import annotations

from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.status import describe_progress, request_progress


def test_progress_through_a_prefill():
    request = Request("r1", list(range(1000)), SamplingParams(max_tokens=4), eos_token_ids=frozenset({0}))
    assert request_progress(request, 5.0)["state"] == "waiting"
    request.scheduled_time, request.num_cached_tokens, request.num_computed_tokens = 10.0, 256, 512
    progress = request_progress(request, 12.0)
    assert progress == {"id": "r1", "state": "prefilling", "prefill_tokens": 1000, "prefilled_tokens": 512,
                        "cached_tokens": 256, "prefill_tokens_per_s": 128.0, "output_tokens": 0, "priority": 0}
    assert describe_progress(progress) == "r1 512/1000 tokens (256 cached), 128.0 tokens/s"
    request.num_computed_tokens = 1000
    done = request_progress(request, 13.0)
    assert done["state"] == "decoding" and done["prefill_tokens_per_s"] is None
