"""Pool the compare step's `bench serve` results over every start of each server (tools/gpu-bench.sh).

A server named more than once in SERVERS is started once per name, in turns with the others, so host
drift within a call hits every server alike; its starts write serve-<server>-<key>.json, then
serve-<server>-<key>-2.json, -3 ... (key: the shape and $TAG). Per server and concurrency level the pooled
aggregate is the sum of completion tokens over the sum of wall seconds of all starts, not a mean of
rates: a start whose level ran longer weighs more. Other servers' rows carry mlxhost's pooled aggregate
over theirs. TTFT p50 / p99 are taken over every request of every start (where the JSON lists them), and
"first wave" over the first `concurrency` requests of each start's level: the burst that opens it.
Standard library only (it runs on the GPU machine beside the bench).
usage: python3 tools/pool_serve.py OUT_DIR KEY  (prints a table, writes OUT_DIR/pooled-KEY.json)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BASE = "mlxhost"  # the server the others are compared with


def find_starts(out_dir: Path, key: str) -> dict[str, list[Path]]:
    """server -> its serve JSON files for `key`, in start order."""
    pattern = re.compile(rf"serve-(?P<server>.+)-{re.escape(key)}(?:-(?P<start>\d+))?\.json")
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in out_dir.glob("serve-*.json"):
        match = pattern.fullmatch(path.name)
        if match:
            found.setdefault(match["server"], []).append((int(match["start"] or 1), path))
    return {server: [p for _, p in sorted(starts)] for server, starts in sorted(found.items())}


def pool(starts: dict[str, list[dict]]) -> list[dict]:
    """One row per (server, concurrency) over the `levels` of each start's serve JSON."""
    rows: dict[tuple[str, int], dict] = {}
    for server, results in starts.items():
        for result in results:
            for level in result["levels"]:
                row = rows.setdefault((server, level["concurrency"]), {
                    "server": server, "concurrency": level["concurrency"], "num_starts": 0,
                    "num_completion_tokens": 0, "wall_s": 0.0, "num_errors": 0, "start_agg_tok_s": [],
                    "ttfts": [], "first_wave_ttfts": []})
                row["num_starts"] += 1
                row["num_completion_tokens"] += level["num_completion_tokens"]
                row["wall_s"] += level["wall_s"]
                row["num_errors"] += level["num_errors"]
                row["start_agg_tok_s"].append(level["num_completion_tokens"] / level["wall_s"])
                ttfts = [r.get("ttft_s") for r in level.get("requests") or ()]
                row["ttfts"] += [t for t in ttfts if t is not None]
                row["first_wave_ttfts"] += [t for t in ttfts[:level["concurrency"]] if t is not None]
    for row in rows.values():
        row["agg_tok_s"] = row["num_completion_tokens"] / row["wall_s"]
        ttfts, first = row.pop("ttfts"), row.pop("first_wave_ttfts")
        row["ttft_p50_ms"], row["ttft_p99_ms"] = percentile(ttfts, 50), percentile(ttfts, 99)
        row["first_wave_ttft_p50_ms"] = percentile(first, 50)
    for (server, conc), row in rows.items():
        base = rows.get((BASE, conc))
        comparable = base and server != BASE and row["agg_tok_s"]  # a level of only errors has no rate
        row["mlxhost_ratio"] = base["agg_tok_s"] / row["agg_tok_s"] if comparable else None
    return sorted(rows.values(), key=lambda r: (r["concurrency"], r["server"] != BASE, r["server"]))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile in ms, interpolated between the nearest ranks as numpy's default (bench serve's)."""
    if not values:
        return None
    values = sorted(values)
    at = (len(values) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return (values[low] + (values[high] - values[low]) * (at - low)) * 1000


def format_rows(rows: list[dict]) -> str:
    lines = ["| server | conc | starts | tokens | wall s | pooled agg tok/s | per start | errors | mlxhost / this "
             "| TTFT p50 ms | TTFT p99 ms | first wave TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for r in rows:
        ratio = "" if r["mlxhost_ratio"] is None else f"{r['mlxhost_ratio']:.3f}x"
        per_start = ", ".join(f"{x:.1f}" for x in r["start_agg_tok_s"])
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['num_starts']} | {r['num_completion_tokens']} | "
                     f"{r['wall_s']:.2f} | {r['agg_tok_s']:.1f} | {per_start} | {r['num_errors']} | {ratio} | "
                     f"{ms(r['ttft_p50_ms'])} | {ms(r['ttft_p99_ms'])} | {ms(r['first_wave_ttft_p50_ms'])} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.rstrip().splitlines()[-1], file=sys.stderr)
        return 2
    out_dir, key = Path(argv[0]), argv[1]
    paths = find_starts(out_dir, key)
    if not paths:
        print(f"pool_serve: no serve-*-{key}.json in {out_dir}")
        return 0  # every server failed to start: nothing to pool, and the bench's own log says why
    rows = pool({server: [json.loads(p.read_text()) for p in files] for server, files in paths.items()})
    print(f"pooled over starts ({key}):")
    print(format_rows(rows))
    target = out_dir / f"pooled-{key}.json"
    files = {server: [p.name for p in files] for server, files in paths.items()}
    target.write_text(json.dumps({"key": key, "files": files, "levels": rows}, indent=2) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
