"""`mlxhost bench prefix --shape` on a tiny sliding-window fixture: a multi-turn row with its hit, the
restore time reported beside it, and the same after a restart from the SSD tier."""

import json

from mlxhost.server.cli import make_parser


def test_prefix_bench_on_a_shape(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    args = make_parser().parse_args([
        "bench", "prefix", "--shape", "gemma3_text", "--prefix-tokens", "300", "--suffix-tokens", "8",
        "--answer-tokens", "4", "--block-size", "64", "--repeats", "1", "--decode-tokens", "4", "--ssd",
        "--output-json", str(out),
    ])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "built gemma3_text" in printed and "restore" in printed
    (row,) = json.loads(out.read_text())["rows"]
    assert row["hit_tokens"] == 256  # turn 1 (308 prompt tokens + its answer) minus the partial block
    assert row["restore_hit_ms"] > 0 and row["restore_ssd_ms"] > 0 and row["ssd_read_ms"] > 0


def test_vary_lengths_gives_every_request_a_new_length(tmp_path, monkeypatch):
    from mlxhost.bench import prefix

    lengths, run_one = [], prefix._run_one

    def record(core, prompt, *a, **kw):
        lengths.append(len(prompt))
        return run_one(core, prompt, *a, **kw)

    monkeypatch.setattr(prefix, "_run_one", record)
    args = make_parser().parse_args([
        "bench", "prefix", "--prefix-tokens", "40,40", "--suffix-tokens", "4", "--block-size", "16,32",
        "--answer-tokens", "2", "--repeats", "2", "--decode-tokens", "2", "--vary-lengths", "--output-json", str(tmp_path / "p.json"),
    ])
    assert args.func(args) == 0
    # Per block size: a warm-up request, then 2 prefixes x 2 repeats x (cold, hit); then 4 decode checks.
    assert len(lengths) == 2 * (1 + 8) + 4
    measured = lengths[1:9] + lengths[10:18]
    assert len(set(measured)) == len(measured), measured


def test_together_rows_with_and_without_the_inflight_wait(tmp_path, capsys):
    out = tmp_path / "together.json"
    args = make_parser().parse_args([
        "bench", "prefix", "--shape", "qwen3", "--together", "300", "--block-size", "16", "--prefill-step-size", "32",
        "--repeats", "1", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    assert "2nd cached" in capsys.readouterr().out
    off, on = json.loads(out.read_text())["together"]
    assert (off["wait"], off["second_cached"], off["prefilled_tokens"]) == ("off", 0, 600)
    # The second waits for the first's blocks: all of its prompt but the last partial block is a hit.
    assert (on["wait"], on["second_cached"], on["prefilled_tokens"]) == ("on", 288, 312)
