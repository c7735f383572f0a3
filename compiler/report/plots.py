"""The report's plots, as inline SVG text from matplotlib (the Agg-free SVG backend: no display, no files)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

# One colour per meaning, so the screenshot test (and a reader) can find each plot's marks.
BAR_COLOUR = "#1f77b4"
HISTOGRAM_COLOUR = "#2ca02c"
THRESHOLD_COLOUR = "#d62728"
MAX_BARS = 24


def _svg(figure: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and DOCTYPE: the SVG sits inside HTML


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("svg", force=False)  # a headless backend; never opens a window
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "svg.hashsalt": "tensorsmith"})
    return plt


def sensitivity_chart(layers: Sequence[dict[str, Any]], metric: str) -> str:
    """Horizontal bars: the metric's loss when only that layer is quantized, most sensitive on top."""
    plt = _pyplot()
    shown = list(layers[:MAX_BARS])
    if metric == "max-abs":
        losses, label = [layer["sensitivity"] for layer in shown], "max |diff| with only this layer quantized"
    elif metric == "sqnr-db":
        losses, label = [layer["sensitivity"] for layer in shown], "SQNR (dB) with only this layer quantized"
    else:
        losses = [max(1.0 - layer["sensitivity"], 1e-9) for layer in shown]
        label = f"1 − {metric} with only this layer quantized (log scale)"
    names = [layer["module"] or layer["name"] for layer in shown]
    figure, axes = plt.subplots(figsize=(7, 0.25 * len(shown) + 1.0))
    axes.barh(range(len(shown)), losses, color=BAR_COLOUR)
    axes.set_yticks(range(len(shown)), names)
    axes.invert_yaxis()
    if metric not in ("max-abs", "sqnr-db"):
        axes.set_xscale("log")
    axes.set_xlabel(label)
    return _svg(figure)


def histogram_chart(entry: dict[str, Any]) -> str:
    """|x| counts over the calibration grid's range (log counts), with the chosen threshold as a vertical line."""
    plt = _pyplot()
    counts = entry["counts"]
    width = entry.get("range", entry["amax"]) / len(counts) if counts else 0.0
    figure, axes = plt.subplots(figsize=(3.6, 2.2))
    edges = [index * width for index in range(len(counts) + 1)]
    axes.stairs(counts, edges, fill=True, color=HISTOGRAM_COLOUR)
    axes.axvline(entry["threshold"], color=THRESHOLD_COLOUR, linewidth=1.5)
    axes.set_yscale("symlog")
    axes.set_title(entry["tensor"][-48:], fontsize=8)
    axes.set_xlabel(f"|x|  (threshold {entry['threshold']:.3g}, amax {entry['amax']:.3g})")
    return _svg(figure)


def accuracy_chart(variants: Sequence[dict[str, Any]], metric: str = "cosine") -> str | None:
    """One bar per variant that has the metric (quantized variants measured against fp32)."""
    measured = [variant for variant in variants if metric in variant["accuracy"]]
    if not measured:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(5, 0.35 * len(measured) + 0.9))
    values = [variant["accuracy"][metric] for variant in measured]
    axes.barh(range(len(measured)), values, color=BAR_COLOUR)
    axes.set_yticks(range(len(measured)), [variant["name"] for variant in measured])
    axes.invert_yaxis()
    axes.set_xlim(min(values) - 0.01, 1.0)
    axes.set_xlabel(f"{metric} against fp32 (held-out data)")
    return _svg(figure)


def steps_chart(steps: Sequence[tuple[str, float]]) -> str:
    """Where the compile spent its time: one bar per pipeline step."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 0.28 * len(steps) + 0.9))
    axes.barh(range(len(steps)), [seconds for _, seconds in steps], color=BAR_COLOUR)
    axes.set_yticks(range(len(steps)), [name[:60] for name, _ in steps])
    axes.invert_yaxis()
    axes.set_xlabel("seconds")
    return _svg(figure)
