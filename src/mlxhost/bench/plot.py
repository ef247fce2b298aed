"""PNG charts of bench results: `mlxhost bench plot FILE.json ...`, `bench serve --plot` (tok/s, TTFT and
per-request tok/s vs concurrency, one bar per result file side by side: e.g. mlxhost vs mlx_lm.server),
`bench prefix --plot` (TTFT cold / prefix-cache hit / after a restart from the SSD tier) and
`bench memory --plot` (memory over a long generation, with and without --kv-prealloc).

matplotlib is the optional `plot` extra; it draws with the Agg backend (files only, no display needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PLOT_HINT = 'pip install "mlxhost[plot]"'
# (level key, axis title); a chart is drawn when some file has the key.
METRICS = (("agg_tok_s", "aggregate output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
           ("decode_tok_s_per_req", "decode tok/s per request"))
FIGSIZE, DPI = (5.0, 3.6), 100  # inches per chart: 500 x 360 pixels each


class PlotUnavailableError(RuntimeError):
    pass


def load_series(paths: list[str | Path]) -> list[tuple[str, list[dict]]]:
    """(label, levels) per server: the run's `--label`, else the file's name. A `bench compare` file holds
    several servers' levels, each labelled with its server: one series each."""
    series = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        levels = data.get("levels") if isinstance(data, dict) else None
        if not levels or not all("concurrency" in lv for lv in levels):
            raise ValueError(f"{path}: not a `bench serve` result (no levels with a concurrency)")
        fallback = (data.get("config") or {}).get("label") or Path(path).stem
        by_label: dict[str, list[dict]] = {}
        for lv in levels:
            by_label.setdefault(str(lv.get("label") or fallback), []).append(lv)
        series.extend(by_label.items())
    return series


def _charts(num_charts: int):
    """(pyplot, figure, axes): `num_charts` charts side by side, FIGSIZE x DPI pixels each."""
    try:
        import matplotlib  # optional: the plot extra
    except ImportError:
        raise PlotUnavailableError(f"plots need matplotlib: {PLOT_HINT}") from None
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, num_charts, figsize=(FIGSIZE[0] * num_charts, FIGSIZE[1]), dpi=DPI, squeeze=False)
    return plt, fig, list(axes[0])


def _save(plt, fig, out: str | Path, title: str | None) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # No bbox_inches="tight": the PNG keeps the size asked for (FIGSIZE x DPI per chart).
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _bars(ax, groups: list[str], series: list[tuple[str, list[float | None]]]) -> None:
    """One bar per series in each group, side by side; a missing value draws no bar."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=label)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def plot_series(series: list[tuple[str, list[dict]]], out: str | Path, title: str | None = None) -> Path:
    """Writes one PNG with a chart per metric in METRICS present in the results."""
    metrics = [(k, t) for k, t in METRICS if any(lv.get(k) is not None for _, levels in series for lv in levels)]
    if not metrics:
        raise ValueError("the results hold none of " + ", ".join(k for k, _ in METRICS))
    levels_x = sorted({lv["concurrency"] for _, levels in series for lv in levels})
    plt, fig, axes = _charts(len(metrics))
    for ax, (key, axis_title) in zip(axes, metrics):
        bars = []
        for label, levels in series:
            by_c = {lv["concurrency"]: lv.get(key) for lv in levels}
            bars.append((label, [by_c.get(c) for c in levels_x]))
        _bars(ax, [str(c) for c in levels_x], bars)
        ax.set_xlabel("concurrent requests")
        ax.set_title(axis_title)
    axes[0].legend(fontsize="small")
    return _save(plt, fig, out, title)


def plot_prefix(rows: list[dict], out: str | Path, title: str | None = None) -> Path:
    """`bench prefix` rows: TTFT cold, on a prefix-cache hit and (with --ssd) after a restart, per prefix length
    (log scale: a hit is often 10-100x faster than cold)."""
    if not rows:
        raise ValueError("no prefix-bench rows to plot")
    one_block = len({r["block_size"] for r in rows}) == 1
    groups = [f"{r['prefix_tokens']}" if one_block else f"{r['prefix_tokens']} (block {r['block_size']})"
              for r in rows]
    series = [("cold", [r["ttft_cold_ms"] for r in rows]), ("prefix-cache hit", [r["ttft_hit_ms"] for r in rows])]
    if any(r.get("ttft_ssd_ms") is not None for r in rows):
        series.append(("restart (SSD tier)", [r.get("ttft_ssd_ms") for r in rows]))
    plt, fig, (ax,) = _charts(1)
    _bars(ax, groups, series)
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix (tokens)")
    ax.set_title("TTFT (ms)")
    ax.legend(fontsize="small")
    return _save(plt, fig, out, title)


def plot_memory(timeline: dict[str, dict], out: str | Path, title: str | None = None) -> Path:
    """`bench memory` timeline runs ({"off": run, "on": run}): MLX active memory and process RSS per decode
    step, above the engine's baseline, one line per run."""
    if not timeline:
        raise ValueError("no memory timeline to plot")
    mib = 1 << 20
    plt, fig, (active_ax, rss_ax) = _charts(2)
    for name, run in timeline.items():
        label = f"--kv-prealloc {run['kv_prealloc_tokens']}" if run["kv_prealloc_tokens"] else "no prealloc"
        n = max(1, len(run["active"]) - 2)  # the last steps free the finished request: not growth
        active_ax.plot([v / mib for v in run["active"][:n]], label=label)
        rss_ax.plot([(v - run["rss"][0]) / mib for v in run["rss"][:n]], label=label)
    for ax, axis_title in ((active_ax, "MLX active memory (MiB)"), (rss_ax, "process RSS growth (MiB)")):
        ax.set_xlabel("decode step")
        ax.set_title(axis_title)
        ax.grid(alpha=0.3)
    active_ax.legend(fontsize="small")
    return _save(plt, fig, out, title)


def default_png_path(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


def add_plot_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                        help="also chart the result (matplotlib, the `plot` extra); PNG alone: the JSON's name"
                             " with .png (default: no chart)")


def write_plot(draw, data, png: str | None, json_path: str | Path | None, fallback: str = "bench.png") -> None:
    """`--plot [PNG]`: draw(data, path) to PNG, else next to the JSON, else `fallback`; a missing matplotlib is a
    message, not a failed run (the numbers are already written)."""
    out = png or (json_path and default_png_path(json_path)) or fallback
    try:
        print(f"wrote {draw(data, out)}", file=sys.stderr)
    except (PlotUnavailableError, ValueError) as exc:
        print(f"no plot: {exc}", file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE.json",
                   help="`bench serve` / `bench compare` result files (one bar per server), or one `bench prefix` or"
                        " `bench memory` file")
    p.add_argument("--output", "-o", default=None, help="PNG to write (default: the first file's name with .png)")
    p.add_argument("--title", default=None, help="title above the charts")


def _chart_of(paths: list[str]):
    """(draw, data) for the files: a prefix or memory result (one file) has its own chart."""
    data = json.loads(Path(paths[0]).read_text())
    if isinstance(data, dict) and ("timeline" in data or "decode" in data):
        if len(paths) > 1:
            raise ValueError("a `bench prefix` or `bench memory` result is charted alone")
        return (plot_memory, data["timeline"]) if "timeline" in data else (plot_prefix, data["rows"])
    return plot_series, load_series(paths)


def run(args: argparse.Namespace) -> int:
    try:
        draw, data = _chart_of(args.files)
        out = draw(data, args.output or default_png_path(args.files[0]), args.title)
    except (PlotUnavailableError, ValueError, OSError) as exc:
        print(f"mlxhost bench plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0
