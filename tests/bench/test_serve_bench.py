"""The serve bench against a tiny fake OpenAI-style SSE server on 127.0.0.1.

Timing values are only checked for being >= 0: wall-clock numbers vary by machine.
"""

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import (
    ServeBenchConfig,
    ServeBenchError,
    add_arguments,
    run,
    run_level,
    run_serve_bench,
    summarize_level,
)
from mlxhost.bench.serve_request import RequestResult, decode_rate, e2e_rate, make_prompt, pooled_rate

# Five SSE events, six tokens: " brown fox" stands for one event that carries two.
PIECES = ["The", " quick", " brown fox", " jumps", " over"]
NUM_TOKENS = 6


def make_fake_app(received: list[dict]) -> FastAPI:
    """Model "fail" -> HTTP 500; model "no-usage" -> no usage chunk; else usage at the end."""
    app = FastAPI()

    async def events(body: dict, chat: bool):
        if chat:  # OpenAI sends the role first, with no content
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for piece in PIECES:
            await asyncio.sleep(0.001)
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            yield _sse({"choices": [choice], "usage": None})
        if body["model"] != "no-usage":
            usage = {"prompt_tokens": 10, "completion_tokens": NUM_TOKENS, "total_tokens": 10 + NUM_TOKENS}
            yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        received.append(body)
        if body["model"] == "fail":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        return StreamingResponse(events(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def fake_server():
    received: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_fake_app(received), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def server(fake_server):
    url, received = fake_server
    received.clear()
    return url, received


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _assert_times_non_negative(level: dict) -> None:
    for key in ("wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "decode_tok_s_per_req", "e2e_tok_s_per_req", "agg_tok_s", "req_s"):
        assert level[key] is not None and level[key] >= 0, key


def test_completions_levels(server, tmp_path):
    url, received = server
    out = tmp_path / "nested" / "serve.json"
    cfg = ServeBenchConfig(url=url, model="fake", concurrency=[1, 4], num_requests=6,
                           prompt_tokens=32, max_tokens=16, label="fake", output_json=str(out))
    result = asyncio.run(run_serve_bench(cfg))

    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    assert result["warmup"] == {"num_requests": 1, "num_errors": 0}
    for level in result["levels"]:
        assert level["label"] == "fake"
        assert (level["num_requests"], level["num_ok"], level["num_errors"]) == (6, 6, 0)
        assert level["num_completion_tokens"] == 6 * NUM_TOKENS
        assert level["mean_prompt_tokens"] == 10
        assert all(r["num_completion_tokens"] == NUM_TOKENS for r in level["requests"])
        assert all(r["num_chunks"] == len(PIECES) for r in level["requests"])
        _assert_times_non_negative(level)

    # Warmup + 2 levels x 6; every body streams with usage, greedy, and distinct prompts.
    assert len(received) == 13
    for body in received:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["max_tokens"] == 16 and body["ignore_eos"] is True
        assert body["prompt"].startswith("Request ")
    assert len({body["prompt"] for body in received}) == len(received)

    saved = json.loads(out.read_text())
    assert saved["config"]["concurrency"] == [1, 4]
    assert len(saved["levels"]) == 2


def test_each_finished_level_is_saved_before_the_next_runs(server, tmp_path):
    # A run cut by a time limit (the GPU scripts' `timeout`) keeps the levels it finished.
    url, _ = server
    out = tmp_path / "serve.json"
    cfg = ServeBenchConfig(url=url, model="fake", concurrency=[1, 2], num_requests=2, prompt_tokens=16,
                           max_tokens=8, output_json=str(out))
    saved = []
    asyncio.run(run_serve_bench(cfg, on_level=lambda level: saved.append(json.loads(out.read_text()))))
    assert [[lv["concurrency"] for lv in s["levels"]] for s in saved] == [[1], [1, 2]]
    assert [s["partial"] for s in saved] == [True, False]


def test_url_with_v1_and_chat_without_usage(server):
    url, received = server
    cfg = ServeBenchConfig(url=url + "/v1/", model="no-usage", concurrency=[2], num_requests=3,
                           endpoint="chat", warmup=0, ignore_eos=False)
    level = asyncio.run(run_level(cfg, 2))
    assert (level["num_ok"], level["num_errors"]) == (3, 0)
    # No usage chunk: tokens are counted as content chunks; the empty role chunk is not one.
    assert level["num_completion_tokens"] == 3 * len(PIECES)
    assert level["mean_prompt_tokens"] is None
    assert all("messages" in body and "ignore_eos" not in body for body in received)


def test_http_500_counts_as_errors(server):
    url, received = server
    cfg = ServeBenchConfig(url=url, model="fail", concurrency=[1, 4], num_requests=5, warmup=0)
    result = asyncio.run(run_serve_bench(cfg))
    for level in result["levels"]:
        assert (level["num_ok"], level["num_errors"]) == (0, 5)
        assert level["ttft_p50_ms"] is None and level["num_completion_tokens"] == 0
        assert level["error_samples"][0].startswith("HTTP 500")
    assert len(received) == 10


def test_failed_warmup_stops_the_bench(server):
    url, _ = server
    cfg = ServeBenchConfig(url=url, model="fail", concurrency=[1])
    with pytest.raises(ServeBenchError, match="HTTP 500"):
        asyncio.run(run_serve_bench(cfg))


def test_refused_connection_counts_as_errors():
    cfg = ServeBenchConfig(url=_closed_port_url(), model="x", concurrency=[2], num_requests=2, warmup=0)
    level = asyncio.run(run_level(cfg, 2))
    assert (level["num_ok"], level["num_errors"]) == (0, 2)
    assert level["error_samples"]


def test_cli_run_prints_table_and_writes_json(server, tmp_path, capsys):
    url, _ = server
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "cli.json"
    args = parser.parse_args(["--url", url, "--model", "fake", "--concurrency", "1,2",
                              "--num-requests", "2", "--label", "fakesrv", "--output-json", str(out)])
    assert run(args) == 0
    table = capsys.readouterr().out
    assert "ttft p50" in table and "agg tok/s" in table and "fakesrv" in table
    assert len(json.loads(out.read_text())["levels"]) == 2

    bad = parser.parse_args(["--url", url, "--model", "fail", "--concurrency", "1", "--no-json"])
    assert run(bad) == 2


def test_cli_plot_writes_a_png_of_the_expected_size(server, tmp_path):
    pytest.importorskip("matplotlib")
    import struct

    from mlxhost.bench import plot
    from mlxhost.server import cli

    url, _ = server
    out = tmp_path / "run.json"
    assert cli.main(["bench", "serve", "--url", url, "--model", "fake", "--concurrency", "1,2", "--num-requests", "2",
                     "--output-json", str(out), "--plot"]) == 0
    png = (tmp_path / "run.png").read_bytes()  # default: next to the JSON
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # IHDR: width, height; one chart per metric the result holds (all three here).
    assert struct.unpack(">II", png[16:24]) == (len(plot.METRICS) * plot.FIGSIZE[0] * plot.DPI,
                                                 plot.FIGSIZE[1] * plot.DPI)
    named = tmp_path / "named.png"
    assert cli.main(["bench", "serve", "--url", url, "--model", "fake", "--concurrency", "1", "--num-requests", "2",
                     "--no-json", "--plot", str(named)]) == 0
    assert named.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_validation_and_urls():
    cfg = ServeBenchConfig(url="http://127.0.0.1:8000", model="m", concurrency=[1])
    assert cfg.request_url == "http://127.0.0.1:8000/v1/completions"
    chat = ServeBenchConfig(url="http://127.0.0.1:8000/v1", model="m", concurrency=[1], endpoint="chat")
    assert chat.request_url == "http://127.0.0.1:8000/v1/chat/completions"
    assert cfg.num_requests_for(1) >= 4 and cfg.num_requests_for(16) >= 32
    for bad in ({"concurrency": []}, {"concurrency": [0]}, {"endpoint": "embeddings"}, {"url": "localhost"}):
        with pytest.raises(ValueError):
            ServeBenchConfig(**{"url": "http://h:1", "model": "m", "concurrency": [1], **bad})


def test_make_prompt_is_seeded_and_unique():
    assert make_prompt(0, "c1", 3, 64) == make_prompt(0, "c1", 3, 64)
    prompts = {make_prompt(0, tag, i, 64) for tag in ("c1", "c4") for i in range(20)}
    assert len(prompts) == 40
    assert make_prompt(0, "c1", 3, 64) != make_prompt(1, "c1", 3, 64)
    assert make_prompt(0, "c1", 7, 64).startswith("Request c1.7: ")
    assert 40 <= len(make_prompt(0, "c1", 0, 64).split()) <= 64


def test_format_table_aligns_columns():
    rows = [{"name": "mlxhost", "conc": 1, "tps": 12.345}, {"name": "b", "conc": 16, "tps": None}]
    text = format_table(rows, [("name", "server", ""), ("conc", "conc", "d"), ("tps", "tok/s", ".1f")])
    lines = text.splitlines()
    assert lines[0].split() == ["server", "conc", "tok/s"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["mlxhost", "1", "12.3"]
    assert lines[3].split() == ["b", "16", "-"]
    # Strings are left-aligned, numbers right-aligned, so every row's columns line up.
    assert lines[2].index("1 ") == lines[3].index("16") + 1
    assert lines[2].endswith("12.3") and len(lines[3]) == len(lines[2])


def test_write_json_creates_parent_dirs(tmp_path):
    path = write_json(tmp_path / "a" / "b" / "r.json", {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}


def test_per_request_rates_by_hand():
    # 11 tokens, the first at 0.10 s, the last at 0.60 s, the stream ends at 0.62 s.
    assert decode_rate(11, 0.5) == pytest.approx(20.0)  # 10 tokens after the first over 0.5 s
    assert e2e_rate(11, 0.62) == pytest.approx(11 / 0.62)  # 17.74: every token over the whole request
    assert decode_rate(1, 0.5) is None and decode_rate(5, 0.0) is None and decode_rate(5, None) is None
    assert e2e_rate(3, 0.0) is None
    # Pooled: (10 + 4) tokens over (0.5 + 0.001) s = 27.94 tok/s; a mean of the two ratios would say 2010.
    assert pooled_rate([(10, 0.5), (4, 0.001)]) == pytest.approx(14 / 0.501)
    assert pooled_rate([]) is None


def test_a_burst_cannot_swamp_the_level():
    # Concurrency 1, four requests of 128 tokens, each 0.342 s end to end (wall 1.368 s: agg 374.3 tok/s).
    # Three streamed evenly (first token at 0.042 s, last at 0.342 s); one arrived in a burst, its 127 tokens
    # after the first within 4.86 ms: alone that is 26,131 tok/s.
    steady = [RequestResult(ttft_s=0.042, decode_s=0.300, e2e_s=0.342, num_chunks=128, num_completion_tokens=128)
              for _ in range(3)]
    burst = RequestResult(ttft_s=0.337, decode_s=0.00486, e2e_s=0.342, num_chunks=128, num_completion_tokens=128)
    assert burst.decode_tok_s == pytest.approx(26131.7, abs=0.1)
    cfg = ServeBenchConfig(url="http://127.0.0.1:1", model="m", concurrency=[1])
    level = summarize_level(cfg, 1, steady + [burst], wall_s=4 * 0.342)
    assert level["agg_tok_s"] == pytest.approx(512 / 1.368)  # 374.3
    assert level["e2e_tok_s_per_req"] == pytest.approx(512 / 1.368)  # one at a time: the same figure
    # 4 x 127 tokens over 3 x 0.300 + 0.00486 s = 561.4 tok/s (the mean of ratios would be 6,628).
    assert level["decode_tok_s_per_req"] == pytest.approx(508 / 0.90486)
    assert level["requests"][3]["e2e_tok_s"] == pytest.approx(128 / 0.342)


def test_decode_time_runs_to_the_last_token_event(server):
    # The fake stream sends five content events; the decode span ends at the last of them (no usage-only
    # event counts), so the rate is the 5 tokens after the first over that span.
    url, _ = server
    cfg = ServeBenchConfig(url=url, model="fake", concurrency=[1], num_requests=2, warmup=0)
    level = asyncio.run(run_level(cfg, 1))
    for r in level["requests"]:
        assert r["decode_tok_s"] == pytest.approx((NUM_TOKENS - 1) / r["decode_s"])
        assert r["e2e_tok_s"] == pytest.approx(NUM_TOKENS / r["e2e_s"])
        assert 0 < r["decode_s"] < r["e2e_s"]


def test_cli_run_logs_no_line_per_request(server, caplog):
    import logging

    url, _ = server
    with caplog.at_level(logging.INFO):
        from mlxhost.server import cli

        assert cli.main(["bench", "serve", "--url", url, "--model", "fake", "--concurrency", "1",
                         "--num-requests", "3", "--no-json"]) == 0
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


def test_bad_concurrency_list_names_the_flag(capsys):
    from mlxhost.server import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--url", "http://127.0.0.1:1", "--model", "m", "--concurrency", "1,x"])
    assert "--concurrency: expected comma-separated whole numbers (e.g. 1,2,4), got '1,x'" in capsys.readouterr().err
