"""Plain-text tables for the reports of `compare_devices` and `python -m tf_metal_ops`.

Kept separate so the report object and the command-line tool print the same layout, and so
the command-line tool can format a table without importing TensorFlow.
"""

from __future__ import annotations

import math
from typing import Sequence


def format_number(value: float | int | None, digits: int = 2) -> str:
    """A short, fixed-width-friendly rendering: `3.1e-07`, `0`, `nan`, `-`."""
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0.0:
        return "0"
    return f"{value:.{digits}e}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces, a rule under the header."""
    columns = len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        if len(row) != columns:
            raise ValueError(f"table row has {len(row)} cells, expected {columns}: {row!r}")
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        return indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [line(headers), indent + "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)
