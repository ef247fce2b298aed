"""Shared output for `mlxhost bench ...`: an aligned plain-text table and a JSON file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

MISSING = "-"


def _format_cell(value: Any, spec: str) -> str:
    if value is None:
        return MISSING
    if isinstance(value, str) or not spec:
        return str(value)
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        # A row may carry a value of another type than the column expects (an
        # int where ".1f" is fine, a string where "d" is not); show it as-is.
        return str(value)


def _is_numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Render `rows` as a table; `columns` holds (key, header, format spec).

    Numeric columns are right-aligned so digits line up; others are left-aligned.
    A missing key or a None value shows as "-".
    """
    headers = [header for _, header, _ in columns]
    cells = [[_format_cell(row.get(key), spec) for key, _, spec in columns] for row in rows]
    right = [
        any(_is_numeric(row.get(key)) for row in rows) for key, _, _ in columns
    ]
    widths = [
        max([len(headers[i])] + [len(line[i]) for line in cells]) for i in range(len(columns))
    ]

    def render(line: list[str]) -> str:
        parts = [
            text.rjust(widths[i]) if right[i] else text.ljust(widths[i])
            for i, text in enumerate(line)
        ]
        return "  ".join(parts).rstrip()

    lines = [render(headers), "  ".join("-" * w for w in widths)]
    lines.extend(render(line) for line in cells)
    return "\n".join(lines)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON, creating parent directories; returns the path.

    Written to a temp file then renamed, so an interrupted run never leaves a
    truncated result that a later comparison would choke on.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, target)
    return target


def percentile(values: list[float], q: float, scale: float = 1.0) -> float | None:
    """The q-th percentile times `scale` (1000 turns seconds into ms); None when empty."""
    return float(np.percentile(values, q)) * scale if values else None


def mean(values: list[float], scale: float = 1.0) -> float | None:
    return float(np.mean(values)) * scale if values else None
