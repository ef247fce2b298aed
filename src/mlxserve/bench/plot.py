"""`mlxserve bench plot FILE.json ...` and `bench serve --plot`: PNG charts of `bench serve` results.

One chart per metric, concurrency on the x axis, one bar per result file side by side (its label:
`--label`, e.g. mlxserve vs mlx_lm.server). matplotlib is the optional `plot` extra; it draws with
the Agg backend (files only, no display needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PLOT_HINT = 'pip install "mlxserve[plot]"'
# (level key, axis title); a chart is drawn when some file has the key.
METRICS = (("agg_tok_s", "aggregate output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
           ("decode_tok_s_per_req", "decode tok/s per request"))
FIGSIZE, DPI = (5.0, 3.6), 100  # inches per chart: 500 x 360 pixels each


class PlotUnavailableError(RuntimeError):
    pass


def load_series(paths: list[str | Path]) -> list[tuple[str, list[dict]]]:
    """(label, levels) per file; the label is the run's `--label`, else the file's name."""
    series = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        levels = data.get("levels") if isinstance(data, dict) else None
        if not levels or not all("concurrency" in lv for lv in levels):
            raise ValueError(f"{path}: not a `bench serve` result (no levels with a concurrency)")
        label = levels[0].get("label") or (data.get("config") or {}).get("label") or Path(path).stem
        series.append((str(label), levels))
    return series


def plot_series(series: list[tuple[str, list[dict]]], out: str | Path, title: str | None = None) -> Path:
    """Writes one PNG with a chart per metric in METRICS present in the results."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError(f"plots need matplotlib: {PLOT_HINT}") from None
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    metrics = [(k, t) for k, t in METRICS if any(lv.get(k) is not None for _, levels in series for lv in levels)]
    if not metrics:
        raise ValueError("the results hold none of " + ", ".join(k for k, _ in METRICS))
    levels_x = sorted({lv["concurrency"] for _, levels in series for lv in levels})
    fig, axes = plt.subplots(1, len(metrics), figsize=(FIGSIZE[0] * len(metrics), FIGSIZE[1]), dpi=DPI,
                             squeeze=False)
    width = 0.8 / len(series)
    for ax, (key, axis_title) in zip(axes[0], metrics):
        for i, (label, levels) in enumerate(series):
            by_c = {lv["concurrency"]: lv.get(key) for lv in levels}
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(levels_x))]
            ax.bar(xs, [by_c.get(c) or 0 for c in levels_x], width, label=label)
        ax.set_xticks(range(len(levels_x)), [str(c) for c in levels_x])
        ax.set_xlabel("concurrent requests")
        ax.set_title(axis_title)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # No bbox_inches="tight": the PNG keeps the size asked for (FIGSIZE x DPI per chart).
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def default_png_path(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE.json", help="`bench serve` result files (one bar each)")
    p.add_argument("--output", "-o", default=None, help="PNG to write (default: the first file's name with .png)")
    p.add_argument("--title", default=None, help="title above the charts")


def run(args: argparse.Namespace) -> int:
    try:
        out = plot_series(load_series(args.files), args.output or default_png_path(args.files[0]), args.title)
    except (PlotUnavailableError, ValueError, OSError) as exc:
        print(f"mlxserve bench plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0
