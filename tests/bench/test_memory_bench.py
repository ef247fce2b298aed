"""`mlxhost bench memory` at a very small size on the tiny fixture: tables printed, JSON written, and
the numbers say what they should (flat with prealloc; fewer running with admission on)."""

import json

from mlxhost.server.cli import make_parser


def test_memory_bench_small(qwen3_model_dir, tmp_path, capsys):
    out = tmp_path / "memory.json"
    args = make_parser().parse_args([
        "bench", "memory", "--model", str(qwen3_model_dir), "--prompt-tokens", "8", "--num-tokens", "300",
        "--every", "100", "--burst-requests", "6", "--burst-prompt-tokens", "8", "--burst-max-tokens", "12",
        "--burst-kv-budget-tokens", "40", "--output-json", str(out), "--plot",
    ])
    assert args.func(args) == 0
    # --plot: the memory-over-time chart next to the JSON (when the `plot` extra is installed).
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "KV prealloc" in printed and "admission" in printed and "max running" in printed
    result = json.loads(out.read_text())
    off, on = result["timeline"]["off"], result["timeline"]["on"]
    assert off["num_tokens"] == on["num_tokens"] == 300
    assert on["kv_prealloc_tokens"] == 308 and on["active_growth"] == 0 and on["num_active_increases"] == 0
    assert off["active_growth"] > 0  # crossed the first 256-position step
    admitted, unlimited = result["burst"]
    assert (admitted["admission"], unlimited["admission"]) == ("on", "off")
    assert admitted["max_running"] == 2 and unlimited["max_running"] == 6  # 40 // 20 tokens a request
    assert admitted["num_tokens"] == unlimited["num_tokens"] == 6 * 12
    assert admitted["peak_mib"] > 0 and unlimited["peak_mib"] > 0
