"""`mlxhost bench speculative --drafts oracle,dflash`: the oracle replays the `off` run's recorded greedy
output (every draft accepted; the recording kept where `--oracle-recording` says, for every level), and a
DFlash drafter is measured beside it."""

import json

from mlxhost.engine.spec.oracle import load_recording
from mlxhost.server.cli import make_parser


def test_oracle_records_then_replays(tmp_path, capsys):
    out, recording = tmp_path / "spec.json", tmp_path / "oracle.json"
    args = make_parser().parse_args([
        "bench", "speculative", "--drafts", "oracle,dflash", "--workloads", "random", "--concurrency", "1,2",
        "--prompt-tokens", "16", "--max-tokens", "12", "--spec-max-batch", "2", "--output-json", str(out),
        "--oracle-recording", str(recording),
    ])
    assert args.func(args) == 0
    assert "oracle" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["mode"]) for r in rows] == [(c, m) for c in (1, 2)
                                                             for m in ("off", "ngram", "oracle", "dflash")]
    for r in rows:
        assert r["tokens"] == 12 * r["concurrency"]
        if r["mode"] == "oracle":
            assert r["acceptance"] == 1.0 and r["tokens_per_step"] > 2
    assert len(load_recording(recording)) == 2  # both levels' prompts (level 2 repeats level 1's)
