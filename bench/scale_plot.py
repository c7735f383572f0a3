"""Peak RSS against parameters: tensorsmith's compile beside ONNX Runtime GenAI's builder, from `bench.scale`'s
JSON (one file or several, each `{shape: {side: figures}}`; a later file's side replaces an earlier one's), drawn
as an SVG for docs/.

    .venv/bin/python -m bench.scale smollm-135m qwen2.5-0.5b ... --skip-decode \
        '--sides=tensorsmith int4 RTN (cpu),GenAI -p int4' > scale.json
    .venv/bin/python -m bench.scale_plot scale.json [more.json ...] -o docs/peak-rss.svg

A point per shape and side: the side's largest process (wait4's peak RSS), against the checkpoint's parameters (its
bf16 bytes / 2). A side killed for memory (by the kernel, or by bench.scale past its 21 GB limit) is drawn as a
cross at the memory it had reached. The machine's memory is the dashed line.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

MACHINE_GB = 24.0  # this machine's memory (the dashed line)
WIDTH, HEIGHT = 560, 320
LEFT, RIGHT, TOP, BOTTOM = 56, 170, 16, 44  # margins: the legend sits right of the plot
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
AXIS = "#444444"


@dataclass(frozen=True)
class Point:
    parameters: float  # billions
    peak_gb: float
    killed: bool


def points(results: dict[str, dict[str, Any]]) -> dict[str, list[Point]]:
    """Each side's points, by side name, from bench.scale's results (shapes in any order)."""
    series: dict[str, list[Point]] = {}
    for figures in results.values():
        parameters = figures["checkpoint_gb"] / 2  # bf16: two bytes a parameter (GB of 10^9 bytes)
        for side, measured in figures.items():
            if not isinstance(measured, dict) or "peak_rss_gb" not in measured:
                continue
            killed = measured["exit"] != 0
            peak = max(measured["peak_rss_gb"], measured.get("peak_tree_rss_gb", 0.0) if killed else 0.0)
            series.setdefault(side, []).append(Point(parameters, peak, killed))
    return {side: sorted(found, key=lambda point: point.parameters) for side, found in series.items()}


def _text(x: float, y: float, text: str, anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{AXIS}">{escape(text)}</text>'


def chart(series: dict[str, list[Point]]) -> str:
    """A log-x (parameters), linear-y (GB) line per side."""
    every = [point for found in series.values() for point in found]
    low = 10 ** math.floor(math.log10(min(point.parameters for point in every)))
    high = 10 ** math.ceil(math.log10(max(point.parameters for point in every)))
    top_gb = max(MACHINE_GB, *(point.peak_gb for point in every)) * 1.05
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(parameters: float) -> float:
        return LEFT + width * (math.log10(parameters) - math.log10(low)) / (math.log10(high) - math.log10(low))

    def y(gb: float) -> float:
        return TOP + height * (1 - gb / top_gb)

    body = [
        f'<line x1="{LEFT}" y1="{TOP + height}" x2="{LEFT + width}" y2="{TOP + height}" stroke="{AXIS}"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + height}" stroke="{AXIS}"/>',
    ]
    decade = low
    while decade <= high:
        body.append(_text(x(decade), TOP + height + 16, f"{decade:g}B", "middle"))
        decade *= 10
    for gb in range(0, int(top_gb) + 1, 4):
        body.append(_text(LEFT - 6, y(gb) + 4, str(gb), "end"))
    body.append(_text(LEFT + width / 2, HEIGHT - 8, "parameters (billions, log scale)", "middle"))
    middle = TOP + height / 2
    body.append(
        f'<text transform="rotate(-90 14 {middle:.1f})" x="14" y="{middle:.1f}" text-anchor="middle" '
        f'fill="{AXIS}">peak RSS, GB</text>'
    )
    body.append(
        f'<line x1="{LEFT}" y1="{y(MACHINE_GB):.1f}" x2="{LEFT + width}" y2="{y(MACHINE_GB):.1f}" '
        f'stroke="{AXIS}" stroke-dasharray="4 3"/>'
    )
    body.append(_text(LEFT + 4, y(MACHINE_GB) - 4, f"the machine's {MACHINE_GB:g} GB"))
    for index, (side, found) in enumerate(series.items()):
        colour = COLOURS[index % len(COLOURS)]
        path = " ".join(f"{x(p.parameters):.1f},{y(p.peak_gb):.1f}" for p in found)
        body.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for point in found:
            px, py = x(point.parameters), y(point.peak_gb)
            if point.killed:
                body.append(
                    f'<path d="M{px - 5:.1f},{py - 5:.1f}L{px + 5:.1f},{py + 5:.1f}M{px - 5:.1f},'
                    f'{py + 5:.1f}L{px + 5:.1f},{py - 5:.1f}" stroke="{colour}" stroke-width="2"/>'
                )
            else:
                body.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>')
        legend = TOP + 14 + 18 * index
        body.append(
            f'<line x1="{LEFT + width + 12}" y1="{legend - 4}" x2="{LEFT + width + 28}" y2="{legend - 4}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        body.append(_text(LEFT + width + 32, legend, side))
    body.append(_text(LEFT + width + 12, TOP + 14 + 18 * len(series) + 6, "x: killed for memory"))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} '
        f'{HEIGHT}" font-family="sans-serif" font-size="11">' + "".join(body) + "</svg>\n"
    )


def main() -> None:
    arguments = sys.argv[1:]
    if "-o" not in arguments:
        raise SystemExit("usage: python -m bench.scale_plot RESULTS.json [...] -o OUT.svg")
    out = Path(arguments[arguments.index("-o") + 1])
    inputs = [Path(name) for name in arguments[: arguments.index("-o")]]
    results: dict[str, dict[str, Any]] = {}
    for path in inputs:  # a later file's side replaces an earlier one's at the same shape (a rerun)
        for shape, sides in json.loads(path.read_text()).items():
            results.setdefault(shape, {}).update(sides)
    out.write_text(chart(points(results)))
    print(f"wrote {out}: {len(results)} shapes", file=sys.stderr)


if __name__ == "__main__":
    main()
