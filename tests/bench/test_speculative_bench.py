"""`mlxhost bench speculative` at a tiny size: the table printed, the JSON written with its settings,
every mode measured, and the self-draft accepted in full."""

import json

from mlxhost.server.cli import make_parser


def test_speculative_bench_small(tmp_path, capsys):
    out = tmp_path / "spec.json"
    args = make_parser().parse_args([
        "bench", "speculative", "--drafts", "self,noise:0.1,layers:1", "--concurrency", "1,3", "--prompt-tokens", "16",
        "--max-tokens", "12", "--spec-max-batch", "3", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    assert "tok/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["spec_max_batch"] == 3
    rows = result["rows"]
    got = {(r["workload"], r["concurrency"], r["mode"]) for r in rows}
    assert got == {(w, c, m) for w in ("random", "echo") for c in (1, 3)
                   for m in (["off", "ngram"] + (["self", "noise:0.1", "layers:1"] if w == "random" else []))}
    for r in rows:
        assert r["tokens"] == 12 * r["concurrency"] and r["tok_s"] > 0
        if r["mode"] == "self":
            assert r["acceptance"] == 1.0 and r["tokens_per_step"] > 2
        if r["mode"] != "off":
            assert r["plain_steps"] >= 0 and r["row_pauses"] >= 0
