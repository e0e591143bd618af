"""What every suite produces: a table on the terminal, a JSON file and PNG plots."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def table(rows: Sequence[Dict], columns: Sequence[str]) -> str:
    """Rows as an aligned text table; floats with 3 significant digits."""

    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def save(rows: List[Dict], suite: str, out_dir: Path, command: str) -> Path:
    """Write rows with the machine and the command that produced them; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}.json"
    doc = {
        "suite": suite,
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "rows": rows,
    }
    path.write_text(json.dumps(doc, indent=1))
    return path


def plot(
    rows: Sequence[Dict],
    *,
    x: str,
    y: str,
    series: Sequence[str],
    panels: Optional[str],
    title: str,
    path: Path,
    logx: bool = True,
) -> Path:
    """One line per distinct `series` tuple, one panel per distinct `panels` value."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, nor in CI
    import matplotlib.pyplot as plt

    keys = sorted({r[panels] for r in rows}) if panels else [None]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        subset = [r for r in rows if panels is None or r[panels] == key]
        for label in sorted({tuple(r[s] for s in series) for r in subset}):
            points = sorted((r[x], r[y]) for r in subset if tuple(r[s] for s in series) == label)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                label=" ".join(f"{s}={v}" for s, v in zip(series, label)),
            )
        if logx:
            ax.set_xscale("log", base=2)
        _label(ax, x, y, f"{title}" + (f" ({panels}={key})" if panels else ""))
    return _save(fig, path)


def _label(ax, x: str, y: str, title: str) -> None:
    """A panel's axis names, title, grid and legend."""
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def bars(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    xlabel: str,
    title: str,
    path: Path,
    reference: Optional[float] = None,
) -> Path:
    """A horizontal bar per label; `reference` draws a vertical line (e.g. 1.0 for parity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.22 * len(labels) + 1.2))
    ax.barh(range(len(labels)), values)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    if reference is not None:
        ax.axvline(reference, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def scatter(
    rows: Sequence[Dict], *, x: str, y: str, series: str, title: str, path: Path, diagonal: bool = True
) -> Path:
    """One marker per row, coloured by `series`, on log-log axes; `diagonal` draws y = x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for label in sorted({r[series] for r in rows}):
        subset = [r for r in rows if r[series] == label]
        ax.scatter([r[x] for r in subset], [r[y] for r in subset], s=18, label=label)
    if diagonal and rows:
        low = min(min(r[x], r[y]) for r in rows)
        high = max(max(r[x], r[y]) for r in rows)
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _label(ax, x, y, title)
    return _save(fig, path)
