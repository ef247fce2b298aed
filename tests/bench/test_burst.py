"""`bench burst`'s table from `bench serve` levels, no server: each prompt's median TTFT by its length."""

from mlxhost.bench.burst import columns, summarize
from mlxhost.bench.report import format_table


def level(ttfts, errors=0):
    return {"num_errors": errors, "requests": [{"ttft_s": t} for t in ttfts]}


def test_per_prompt_medians_mean_and_max():
    mix = [300, 100]
    row = summarize("rows 8", mix, [level([0.4, 0.1]), level([0.6, 0.3]), level([0.5, None], errors=1)])
    assert row["ttft_0"] == 500 and row["ttft_1"] == 200  # medians over the bursts, in ms
    assert row["ttft_max_ms"] == 500 and row["num_errors"] == 1
    table = format_table([row], columns(mix))
    header = table.splitlines()[0]
    assert header.index("100 tok") < header.index("300 tok")  # shortest prompt first
