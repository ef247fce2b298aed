"""Keys with policies on the real server and the tiny fixture model: a key over its tokens per minute gets a
429 whose Retry-After the official `openai` client honours, a key limited to another model gets a 404,
a concurrency limit holds under 64 parallel requests, /metrics counts by key name, and the prefix cache
is shared across keys under `--cache-isolation none` and not at all under `key`, but for the full blocks of a
shared system prompt (`shared_prefixes:`)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import openai._base_client
import pytest

from mlxhost.config import EngineConfig, SecurityConfig, ServerConfig
from mlxhost.frontends.common.keys import KeyUsage
from mlxhost.server.app import build_app

SERVED_NAME = "tiny"
BS = 16
KEYS = """
keys:
  - {key: sk-metered, name: metered, tokens_per_minute: 10}
  - {key: sk-elsewhere, name: elsewhere, models: [another-model]}
  - {key: sk-two, name: two-at-once, max_concurrent: 2}
  - {key: sk-a, name: a}
  - {key: sk-b, name: b}
"""


class FakeClock:
    """The limits' clock, moved by the test (the client's retry sleep moves it), never by waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keyed_server(model_dir, tmp_path, serve, isolation: str = "none", extra: str = ""):
    path = tmp_path / f"keys-{isolation}.yaml"
    path.write_text(KEYS + extra)
    config = ServerConfig(model=str(model_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=8, block_size=BS),
                          security=SecurityConfig(api_key_file=str(path), cache_isolation=isolation))
    app = build_app(config)
    clock = app.state.key_ring.clock = FakeClock()  # before any request makes a key's usage
    return serve(app), clock


@pytest.fixture(scope="module")
def live(qwen3_model_dir, tmp_path_factory, serve_module_app):
    return keyed_server(qwen3_model_dir, tmp_path_factory.mktemp("keys"), serve_module_app)


def client_for(live, key: str, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=live[0].base_url, api_key=key, max_retries=max_retries, timeout=120)


COMPLETION = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def test_a_key_over_its_tokens_per_minute_gets_a_429_the_client_retries_after(live, monkeypatch):
    server, clock = live
    with client_for(live, "sk-metered") as client:
        first = client.completions.create(**COMPLETION)
        assert first.usage.total_tokens >= 10  # the window is now at its limit
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(**COMPLETION)
    headers = info.value.response.headers
    assert info.value.code == "rate_limit_exceeded"
    retry_after = int(headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert headers["x-ratelimit-limit-tokens"] == "10" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"].endswith("s")

    slept = []

    def sleep(seconds: float) -> None:  # the client's wait between retries: the limits' clock moves instead
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(openai._base_client.time, "sleep", sleep)
    with client_for(live, "sk-metered", max_retries=2) as client:
        again = client.completions.create(**COMPLETION)
    assert again.choices[0].text == first.choices[0].text
    assert slept == [float(retry_after)]  # one retry, after exactly the server's Retry-After


def test_a_key_limited_to_another_model_gets_404(live):
    with client_for(live, "sk-elsewhere") as client, pytest.raises(openai.NotFoundError) as info:
        client.completions.create(**COMPLETION)
    assert info.value.code == "model_not_found"


def test_a_concurrency_limit_holds_under_64_parallel_requests(live, monkeypatch):
    peak, admit = [0], KeyUsage.admit

    def counting_admit(self, policy, in_flight=True):
        refusal = admit(self, policy, in_flight)
        peak[0] = max(peak[0], self.num_in_flight)
        return refusal

    monkeypatch.setattr(KeyUsage, "admit", counting_admit)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live[0].url, timeout=120,
                                     headers={"Authorization": "Bearer sk-two"}) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**COMPLETION, "max_tokens": 16})
                                          for _ in range(64)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(200) >= 2
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in responses if r.status_code == 429)
    assert 1 <= peak[0] <= 2  # never more than the limit in flight


def test_metrics_count_by_key_name_never_the_key(live):
    with client_for(live, "sk-a") as client:
        client.completions.create(**COMPLETION)
    text = httpx.get(live[0].url + "/metrics", headers={"Authorization": "Bearer sk-a"}, timeout=30).text
    assert 'mlxhost_key_requests_total{key="a",status="200"}' in text
    assert 'mlxhost_key_tokens_total{key="a"}' in text
    assert "sk-a" not in text and "sk-metered" not in text


PROMPT = " ".join(f"word{i}" for i in range(60))  # several full blocks


def cached_tokens(live, key: str, prompt: str = PROMPT) -> tuple[int, int]:
    with client_for(live, key) as client:
        usage = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1).usage
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_without_isolation_a_second_key_hits_the_first_keys_blocks(live):
    cached_tokens(live, "sk-a")
    n, cached = cached_tokens(live, "sk-b")
    assert cached == (n - 1) // BS * BS > 0  # every full block but the one holding the last token


def test_isolated_by_key_a_second_key_gets_no_cached_tokens(qwen3_model_dir, tmp_path, serve_module_app):
    isolated = keyed_server(qwen3_model_dir, tmp_path, serve_module_app, isolation="key")
    cached_tokens(isolated, "sk-a")
    n, cached = cached_tokens(isolated, "sk-b")
    assert cached == 0
    assert cached_tokens(isolated, "sk-a")[1] == (n - 1) // BS * BS  # its own blocks it still hits


SHARED = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(30))


def test_isolated_by_key_a_shared_system_prompt_is_shared_and_nothing_after_it(qwen3_model_dir, tmp_path,
                                                                               serve_module_app):
    from mlx_lm.utils import load_tokenizer  # the fixture's tokenizer: where the shared text's tokens end

    extra = f"shared_prefixes:\n  - {SHARED!r}\n"
    isolated = keyed_server(qwen3_model_dir, tmp_path, serve_module_app, isolation="key", extra=extra)
    prompt = SHARED + " and then " + PROMPT  # the same whole prompt from both keys
    tok = load_tokenizer(qwen3_model_dir)
    ids, shared_ids = tok.encode(prompt), tok.encode(SHARED)
    num_shared = next((i for i, (a, b) in enumerate(zip(ids, shared_ids)) if a != b), len(shared_ids))
    assert BS <= num_shared < len(ids) - 2 * BS  # full blocks on both sides of the shared part's end

    n, cached = cached_tokens(isolated, "sk-a", prompt)
    assert (n, cached) == (len(ids), 0)
    assert cached_tokens(isolated, "sk-b", prompt)[1] == num_shared // BS * BS  # the shared part's full blocks
    assert cached_tokens(isolated, "sk-a", prompt)[1] == (n - 1) // BS * BS  # its own blocks, all of them
    assert cached_tokens(isolated, "sk-a", PROMPT)[1] == 0
    assert cached_tokens(isolated, "sk-b", PROMPT)[1] == 0  # a prompt without the shared text: nothing shared


def test_isolated_by_key_a_shared_system_message_is_shared_up_to_the_users_words(qwen3_model_dir, tmp_path,
                                                                                  serve_module_app):
    from mlx_lm.utils import load_tokenizer  # the fixture's chat template: where the shared tokens end

    extra = f"shared_prefixes:\n  - {SHARED!r}\n"
    isolated = keyed_server(qwen3_model_dir, tmp_path, serve_module_app, isolation="key", extra=extra)
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": PROMPT}]
    tok = load_tokenizer(qwen3_model_dir)
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    own = tok.encode(tok.apply_chat_template(messages[:1] + [{"role": "user", "content": ""}],
                                             add_generation_prompt=False, tokenize=False), add_special_tokens=False)
    num_shared = next(i for i, (a, b) in enumerate(zip(ids, own)) if a != b)
    assert BS <= num_shared < len(ids) - 2 * BS

    def chat(key: str) -> int:
        with client_for(isolated, key) as client:
            usage = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=1).usage
        assert usage.prompt_tokens == len(ids)
        return usage.prompt_tokens_details.cached_tokens

    assert chat("sk-a") == 0
    assert chat("sk-b") == num_shared // BS * BS
    assert chat("sk-a") == (len(ids) - 1) // BS * BS
