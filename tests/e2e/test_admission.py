"""Admission control: requests beyond the KV budget wait, and beyond the queue get 429 + Retry-After."""

import asyncio

import httpx

PROMPT_IDS = list(range(10, 60))  # 50 prompt tokens
MAX_TOKENS = 150  # 200 tokens a request: a 600-token budget runs 3 at once


def test_sixteen_long_requests_over_a_small_budget_get_429_not_a_crash(make_server, qwen3_model_dir):
    live = make_server(qwen3_model_dir, max_num_seqs=16, max_num_waiting=4, kv_budget_tokens=600)
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(live.base_url + "/completions", json=body)
                                          for _ in range(16)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 3
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    # The budget was honoured: never more running than 600 // 200.
    status = httpx.get(live.base_url + "/status").json()
    assert status["kv_capacity_tokens"] == 600 and status["num_running"] == 0


def test_a_request_that_can_never_fit_gets_429_naming_the_numbers(make_server, qwen3_model_dir):
    live = make_server(qwen3_model_dir, kv_budget_tokens=100)
    r = httpx.post(live.base_url + "/completions", json={"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 80},
                   timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"]
    message = r.json()["error"]["message"]
    assert "50" in message and "80" in message and "130" in message and "100" in message
    ok = httpx.post(live.base_url + "/completions", json={"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 20},
                    timeout=60)
    assert ok.status_code == 200
