"""The report's plots, as inline SVG text: horizontal bar charts and histograms, a few rectangles, lines and labels
each. Written directly rather than through a plotting library: matplotlib took two seconds of every compile
(its import, and the text layout of log-axis labels), for charts this simple.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from tensorsmith.compiler.report.schema import HistogramRow, SensitivityRow, VariantRow

# One colour per meaning, so the screenshot test (and a reader) can find each plot's marks.
BAR_COLOUR = "#1f77b4"
HISTOGRAM_COLOUR = "#2ca02c"
THRESHOLD_COLOUR = "#d62728"
AXIS_COLOUR = "#444444"
MAX_BARS = 24
FONT = 'font-family="sans-serif" font-size="11"'
ROW = 18  # pixels per bar
LABELS = 120  # pixels for the bar labels, at least: the column widens to its longest label
LABEL_CHARACTER = 6.6  # pixels per character of an 11-pixel sans-serif label, with room to spare
LONGEST_LABEL = 90  # characters; a longer label ends in "…"
PLOT = 420  # pixels for the bars
# An accuracy metric → what its axis says; those bounded by 1 are drawn up to 1.
ACCURACY_AXES = {
    "cosine": "cosine against fp32",
    "min-cosine": "the lowest sample's cosine against fp32",
    "sqnr-db": "SQNR against fp32 (dB)",
    "perplexity-ratio": "perplexity over fp32's",
    "perplexity": "perplexity on the held-out text",
    "next-token-agreement": "next-token agreement with fp32",
}
BOUNDED_BY_ONE = ("cosine", "min-cosine", "next-token-agreement")


def _number(value: float) -> str:
    return f"{value:.3g}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """The ticks as numbers with as few significant digits (3 at least) as keep them apart: a narrow accuracy axis
    (0.998 to 1) needs 4."""
    for digits in range(3, 10):
        labels = [f"{tick:.{digits}g}" for tick in ticks]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _svg(width: int, height: int, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT}>' + "".join(body) + "</svg>"
    )


def _text(x: float, y: float, text: str, anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{AXIS_COLOUR}">{escape(text)}</text>'


def _ticks(low: float, high: float, log: bool) -> list[float]:
    if log:
        return [10.0**k for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)]
    return [low + (high - low) * index / 4 for index in range(5)]


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    xlabel: str,
    log: bool = False,
    low: float | None = None,
    high: float | None = None,
) -> str:
    """One horizontal bar per label, the first on top, over a linear or log axis from `low` to `high`."""
    if log:
        positive = [max(value, 1e-12) for value in values] or [1.0]
        start = math.log10(low) if low else math.floor(math.log10(min(positive)))
        stop = math.log10(high) if high else math.ceil(math.log10(max(positive) * 1.0001))
        stop = max(stop, start + 1)
        lo, hi = 10.0**start, 10.0**stop

        def place(value: float) -> float:
            return PLOT * (math.log10(max(value, lo)) - start) / (stop - start)
    else:
        lo = 0.0 if low is None else low
        hi = high if high is not None else (max(max(values, default=0.0), lo) * 1.05 or 1.0)
        hi = hi if hi > lo else lo + 1.0

        def place(value: float) -> float:
            return PLOT * (min(max(value, lo), hi) - lo) / (hi - lo)

    shown = [label if len(label) <= LONGEST_LABEL else label[: LONGEST_LABEL - 1] + "…" for label in labels]
    left = max(LABELS, math.ceil(LABEL_CHARACTER * max(map(len, shown), default=0)) + 12)  # every label whole
    top, bottom = 8, 8 + ROW * len(values)
    body = []
    for index, (label, value) in enumerate(zip(shown, values, strict=True)):
        y = top + index * ROW
        body.append(
            f'<rect x="{left}" y="{y + 2}" width="{max(place(value), 1):.1f}" height="{ROW - 4}" '
            f'fill="{BAR_COLOUR}" shape-rendering="crispEdges"/>'
        )
        body.append(_text(left - 6, y + ROW - 5, label, "end"))
    body.append(f'<line x1="{left}" y1="{bottom}" x2="{left + PLOT}" y2="{bottom}" stroke="{AXIS_COLOUR}"/>')
    ticks = _ticks(lo, hi, log)
    for tick, label in zip(ticks, tick_labels(ticks), strict=True):
        x = left + place(tick)
        body.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="{AXIS_COLOUR}"/>')
        body.append(_text(x, bottom + 16, label, "middle"))
    body.append(_text(left + PLOT / 2, bottom + 32, xlabel, "middle"))
    return _svg(left + PLOT + 20, bottom + 40, body)


def sensitivity_chart(layers: Sequence[SensitivityRow], metric: str) -> str:
    """Horizontal bars: the metric's loss when only that layer is quantized, most sensitive on top."""
    shown = list(layers[:MAX_BARS])
    names = [layer["module"] or layer["name"] for layer in shown]
    if metric == "max-abs":
        return bar_chart(names, [layer["sensitivity"] for layer in shown], "max |diff| with only this layer quantized")
    if metric == "sqnr-db":
        return bar_chart(names, [layer["sensitivity"] for layer in shown], "SQNR (dB) with only this layer quantized")
    costs = [cost for layer in shown if (cost := layer["cost"]) is not None]
    if len(costs) == len(shown):  # what each costs against the reference
        losses = [max(cost, 1e-9) for cost in costs]
        return bar_chart(names, losses, f"{metric} lost with only this layer quantized (log scale)", log=True)
    return bar_chart(names, [layer["sensitivity"] for layer in shown], f"{metric} with only this layer quantized")


def histogram_chart(entry: HistogramRow) -> str:
    """|x| counts over the calibration grid's range (log counts), with the chosen threshold as a vertical line."""
    counts = [float(count) for count in entry["counts"]]
    covered = entry.get("range", entry["amax"]) or 1.0
    width, height, left, top = 340, 150, 8, 22
    peak = math.log1p(max(counts, default=0.0)) or 1.0
    step = width / max(len(counts), 1)
    points = [f"{left},{top + height}"]
    for index, count in enumerate(counts):
        y = top + height - height * math.log1p(count) / peak
        points += [f"{left + index * step:.2f},{y:.2f}", f"{left + (index + 1) * step:.2f},{y:.2f}"]
    points.append(f"{left + width},{top + height}")
    threshold = left + width * min(entry["threshold"] / covered, 1.0)
    body = [
        _text(left, 14, entry["tensor"][-56:]),
        f'<polygon points="{" ".join(points)}" fill="{HISTOGRAM_COLOUR}"/>',
        f'<line x1="{left}" y1="{top + height}" x2="{left + width}" y2="{top + height}" stroke="{AXIS_COLOUR}"/>',
        f'<rect x="{threshold - 1:.1f}" y="{top}" width="2" height="{height}" fill="{THRESHOLD_COLOUR}" '
        'shape-rendering="crispEdges"/>',
        _text(left, top + height + 14, "0"),
        _text(left + width, top + height + 14, _number(covered), "end"),
        _text(
            left + width / 2,
            top + height + 30,
            f"|x| (threshold {_number(entry['threshold'])}, amax {_number(entry['amax'])}; log counts)",
            "middle",
        ),
    ]
    return _svg(width + 2 * left, top + height + 38, body)


def accuracy_chart(variants: Sequence[VariantRow], metric: str = "cosine") -> str | None:
    """One bar per variant that has the metric (measured against fp32), on an axis that says which metric."""
    measured = [variant for variant in variants if metric in variant["accuracy"]]
    if not measured:
        return None
    values = [variant["accuracy"][metric] for variant in measured]
    if metric in BOUNDED_BY_ONE:
        low, high = min(values) - 0.01, 1.0
    else:  # zoomed on the values: perplexities differ in their second digit
        margin = (max(values) - min(values)) * 0.1 or abs(max(values)) * 0.01 or 1.0
        low, high = min(values) - margin, max(values) + margin
    axis = ACCURACY_AXES.get(metric, metric)
    return bar_chart([variant["name"] for variant in measured], values, axis, low=low, high=high)


def steps_chart(steps: Sequence[tuple[str, float]]) -> str:
    """Where the compile spent its time: one bar per pipeline step."""
    return bar_chart([name for name, _ in steps], [seconds for _, seconds in steps], "seconds")
