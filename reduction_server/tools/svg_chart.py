"""A line chart written as SVG by hand (`size --simulate --plot`): the core carries no plotting
library, and the chart is a few lines and labels."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Sequence
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 150, 40, 50
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")


def _ticks(high: float, count: int = 5) -> List[float]:
    """Round tick values from 0 to at least `high`."""
    if high <= 0:
        return [0.0, 1.0]
    raw = high / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    ticks = [0.0]
    while ticks[-1] < high:
        ticks.append(ticks[-1] + step)
    return ticks


def line_chart(
    xs: Sequence[float], series: Dict[str, Sequence[float]], *, xlabel: str, ylabel: str, title: str, path: Path
) -> Path:
    """One polyline with dots per series over xs, from y = 0; the legend on the right."""
    x_low, x_high = min(xs), max(xs)
    ticks = _ticks(max(max(values) for values in series.values()))
    y_high = ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (0.5 if x_high == x_low else (x - x_low) / (x_high - x_low)) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - y / y_high * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 10}" text-anchor="middle">{escape(xlabel)}</text>',
        f'<text x="15" y="{TOP + plot_h / 2}" text-anchor="middle" transform="rotate(-90 15 {TOP + plot_h / 2})">'
        f"{escape(ylabel)}</text>",
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>',
    ]
    for tick in ticks:
        y = py(tick)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 5}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for x in sorted(set(xs)) if len(set(xs)) <= 16 else [t for t in _ticks(x_high) if x_low <= t <= x_high]:
        parts.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{x:g}</text>')
    for i, (name, values) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, values))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in zip(xs, values)]
        ly = TOP + 15 + 18 * i
        parts.append(
            f'<line x1="{WIDTH - RIGHT + 10}" y1="{ly}" x2="{WIDTH - RIGHT + 30}" y2="{ly}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{WIDTH - RIGHT + 35}" y="{ly + 4}">{escape(name)}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
    return path
