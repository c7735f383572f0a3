"""report.html: one self-contained static page (inline CSS and SVG, no scripts, nothing fetched)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape

from tensorsmith.compiler.report import plots as report_plots
from tensorsmith.compiler.report.schema import Report
from tensorsmith.compiler.report.summary import source_sentence
from tensorsmith.compiler.variants.precision_plan import CpuChoice
from tensorsmith.core.metrics import budget_terms
from tensorsmith.runtime.manifest import SourceRecord

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: 2px 10px; border-bottom: 1px solid #eee;
text-align: left; vertical-align: top; } th { background: #f6f6f6; } .num { text-align: right; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; } .plot svg { max-width: 100%; height: auto; }
.status-built { color: #1a7f37; } .status-failed { color: #cf222e; } .status-pending { color: #9a6700; }
code { font-size: 12px; }
"""


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f'<td class="num">{value:.6g}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value:,}</td>'
    if value is None:
        return "<td></td>"
    return f"<td>{escape(str(value))}</td>"


def _table(columns: Sequence[str], rows: Iterable[Sequence[object]], classes: Sequence[str] = ()) -> str:
    head = "".join(f"<th>{escape(column)}</th>" for column in columns)
    body = []
    for index, row in enumerate(rows):
        css = f' class="{classes[index]}"' if index < len(classes) and classes[index] else ""
        body.append(f"<tr{css}>" + "".join(_cell(value) for value in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _plot(svg: str, caption: str) -> str:
    return f'<figure class="plot">{svg}<figcaption>{escape(caption)}</figcaption></figure>'


def _verdict(report: Report) -> str:
    """What a reader wants first: the budget's outcome, and what each target runs and how large it is."""
    budget, outcomes = report["budget"], report.get("budget_outcomes", {})
    if budget:
        instead = {name: reason for name, outcome in outcomes.items() if (reason := outcome.get("instead"))}
        unmet = [
            name if outcome["achieved"] is None else f"{name} ({outcome['achieved']:.6g})"
            for name, outcome in outcomes.items()
            if not outcome["met"] and name not in instead
        ]
        said = f"not met by {', '.join(unmet)}" if unmet else "met by what every target runs"
        sentence = f"Budget <code>{escape(str(budget))}</code>: <strong>{escape(said)}</strong>."
    else:
        instead = report.get("float_instead", {})
        sentence = "No accuracy budget was asked: each variant's accuracy against the source is under Accuracy."
    sentence += "".join(f" Instead of {escape(name)}, {escape(reason)}." for name, reason in instead.items())
    sizes = {variant["name"]: variant["bytes"] for variant in report["variants"]}
    rows = []
    for engine in report["engines"]:
        runs = f"{engine['variant']} engine" if engine.get("bytes") is not None else engine["variant"]
        size = engine.get("bytes") if engine.get("bytes") is not None else sizes.get(engine["variant"])
        rows.append((engine["target"], runs, engine["status"], f"{size / 1e6:.1f}" if size else ""))
    table = _table(("target", "runs", "status", "MB"), rows)
    return f"<h2>Verdict</h2><p>{sentence}</p>{table}"


def _steps(report: Report) -> str:
    rows = [(step["name"], step["seconds"]) for step in report["steps"]]
    passes = [
        (f"pass {p['name']}" + (f", for variant {p['variant']}" if p.get("variant") else ""), p["seconds"])
        for p in report["passes"]
    ]
    chart = _plot(report_plots.steps_chart(rows), "seconds per step") if rows else ""
    peaks = [f"{rss / 2**30:.2f}" if (rss := step.get("peak_rss_bytes")) else "" for step in report["steps"]]
    table = [(name, seconds, peak) for (name, seconds), peak in zip(rows, peaks, strict=True)]
    return (
        "<h2>Pipeline</h2>"
        + chart
        + _memory(report)
        + _table(("step", "seconds", "peak resident GB"), table + [(name, seconds, "") for name, seconds in passes])
    )


def _memory(report: Report) -> str:
    """Each step's peak resident memory beside the largest variant's size: a compile whose memory follows its output,
    not its source, stays within a few GB of that line at any model size."""
    measured = [(step["name"], rss / 1e9) for step in report["steps"] if (rss := step.get("peak_rss_bytes"))]
    if not measured:
        return ""
    largest = max((variant["bytes"] or 0 for variant in report["variants"]), default=0) / 1e9
    chart = report_plots.bar_chart([name for name, _ in measured], [gb for _, gb in measured], "GB (10^9 bytes)")
    return _plot(chart, f"peak resident memory per step; the largest variant is {largest:.2f} GB")


def _fusion(report: Report) -> str:
    rows = []
    for rule in report["fusion"]:
        misses = "; ".join(f"{miss.get('node', '?')}: {miss.get('reason', '')}" for miss in rule["misses"][:5])
        rows.append((rule["pass"], rule["rule"], rule["matched"], rule["missed"], rule.get("already_fused", 0), misses))
    if not rows:
        return "<h2>Fusion</h2><p>Fusion passes did not run (--no-fuse).</p>"
    columns = ("pass", "rule", "matched", "missed", "already fused by the exporter", "misses (first five)")
    return "<h2>Fusion</h2>" + _table(columns, rows)


def _accuracy(report: Report) -> str:
    rows = []
    for variant in report["variants"]:
        accuracy = ", ".join(f"{key} {value:.6g}" for key, value in variant["accuracy"].items())
        rows.append(
            (variant["name"], " + ".join(variant["precisions"]), variant["bytes"], accuracy, variant["evaluated_on"])
        )
    metric = _charted_metric(report)
    chart = report_plots.accuracy_chart(report["variants"], metric)
    axis = report_plots.ACCURACY_AXES.get(metric, metric)
    plot = _plot(chart, f"each variant's outputs: {axis}") if chart else ""
    columns = ("variant", "precisions", "bytes", "accuracy", "measured on")
    return "<h2>Accuracy per variant</h2>" + plot + _table(columns, rows)


def _charted_metric(report: Report) -> str:
    """The budget's metric where the variants record it (perplexity-ratio under a decoder's budget), else cosine
    (max-abs and a custom metric are not in the variants' figures)."""
    terms = budget_terms(str(report["budget"])) if report["budget"] else None
    if terms is not None and any(terms.metric in variant["accuracy"] for variant in report["variants"]):
        return terms.metric
    return "cosine"


def _calibration(report: Report) -> str:
    calibration = report["calibration"]
    if not report["histograms"] or calibration is None:  # histograms come with a calibration table
        return ""
    intro = (
        f"<p>{escape(calibration['method'])} thresholds from {calibration['samples']} samples; the activations of "
        "the most sensitive layers. Red: the threshold above which values saturate.</p>"
    )
    plots = "".join(
        _plot(
            report_plots.histogram_chart(entry),
            f"{entry['tensor']} ({'quantized' if entry['quantized'] else 'observed, kept in float'})",
        )
        for entry in report["histograms"]
    )
    return f'<h2>Calibration</h2>{intro}<div class="plots">{plots}</div>'


def _sensitivity(report: Report) -> str:
    if not report["sensitivity"]:
        return ""
    terms = budget_terms(str(report["budget"]))
    metric = terms.metric if terms is not None else "cosine"
    parts = ["<h2>Sensitivity</h2>", f"<p>Budget: <code>{escape(str(report['budget']))}</code>.</p>"]
    for precision, layers in report["sensitivity"].items():
        costly = [layer for layer in layers if layer["cost"] is None or layer["cost"] > 0]
        better = len(layers) - len(costly)
        caption = f"{precision}: the layers whose quantization alone costs the most"
        if better:
            caption += f" ({better} measured no worse than the reference when quantized alone: not shown)"
        if costly:
            parts.append(_plot(report_plots.sensitivity_chart(costly, metric), caption))
        else:
            parts.append(f"<p>{escape(precision)}: no layer costs {escape(metric)} when quantized alone.</p>")
    return "".join(parts)


def _plan(report: Report) -> str:
    if not report["plan"]:
        return ""
    parts = ["<h2>Precision plan</h2>"]
    for recipe, layers in report["plan"].items():
        rows = [
            (layer["name"], layer["module"], layer["op"], layer["precision"], layer["sensitivity"], layer["reason"])
            for layer in layers
        ]
        table = _table(("ONNX node", "PyTorch module", "op", "precision", "sensitivity", "reason"), rows)
        parts.append(f"<details open><summary>{escape(recipe)} ({len(rows)} layers)</summary>{table}</details>")
    return "".join(parts)


def _cpu(report: Report) -> str:
    recorded = report.get("cpu")
    if not recorded:
        return ""
    cpu = CpuChoice.model_validate(recorded)
    parts = [
        "<h2>CPU recipe</h2>",
        f"<p>The cpu target runs <code>{escape(cpu.variant)}</code>: {escape(cpu.reason)}.</p>",
    ]
    by_backend = cpu.latency_ms_by_backend
    if by_backend:  # every (variant, backend) pair timed: the fastest chose
        backends = sorted({backend for times in by_backend.values() for backend in times})
        rows = [(name, *(times.get(backend) for backend in backends)) for name, times in by_backend.items()]
        parts.append(_table(("candidate", *(f"ms, batch 8, {backend}" for backend in backends)), rows))
    elif cpu.latency_ms_batch8:
        latency = cpu.latency_ms_batch8
        metrics = cpu.metric  # the figure that chose between them, if any
        columns = ("candidate", "ms, batch 8, ONNX Runtime defaults", *metrics)
        rows = [
            (name, latency[name], *(by_candidate.get(name) for by_candidate in metrics.values()))
            for name in sorted(latency, key=latency.__getitem__)
        ]
        parts.append(_table(columns, rows))
    preparation = cpu.dynamic_preparation
    split = preparation.get("split_outlier_neurons", {})
    units = split.get("units")
    if units and isinstance(units, dict):  # MatMul → the units split off it (passes/outlier_neurons.py)
        parts.append(
            f"<p>Dynamic int8 graph: {split['units_split']} outlier MLP units (max |activation| above "
            f"{split['ratio']:g}x the median unit's) moved to a float branch; "
            f"{preparation.get('smooth_activations', {}).get('activations_smoothed', 0)} activations smoothed; "
            f"{preparation.get('floor_softmax_logits', {}).get('softmax_floored', 0)} Softmax inputs floored at "
            "their row's max − 80 (for ONNX Runtime's fast exp path).</p>"
        )
        parts.append(
            _table(
                ("MLP output MatMul", "units kept in float"),
                [(node, ", ".join(str(unit) for unit in kept)) for node, kept in units.items()],
            )
        )
    session = cpu.onnxruntime_session
    chosen = ", ".join(session.disabled_optimizers) or "none"
    parts.append(f"<p>ONNX Runtime optimizers switched off for it (measured): <code>{escape(chosen)}</code>.</p>")
    if session.latency_ms_batch8:  # timed only where more than one setting was tried
        parts.append(_table(("session", "ms, batch 8"), list(session.latency_ms_batch8.items())))
    return "".join(parts)


def _engines(report: Report) -> str:
    rows, classes = [], []
    for engine in report["engines"]:
        rows.append(
            (
                engine["target"],
                engine["variant"],
                engine["status"],
                engine["builder"],
                engine.get("builder_version"),
                engine.get("bytes"),
                engine.get("build_seconds"),
                engine.get("cache"),
                engine["reason"],
            )
        )
        classes.append(f"status-{engine['status']}")
    columns = ("target", "variant", "status", "builder", "version", "bytes", "build s", "engine cache", "reason")
    return "<h2>Engines</h2>" + _table(columns, rows, classes)


def render_html(report: Report) -> str:
    source = SourceRecord.model_validate(report["source"])
    title = f"tensorsmith report: {report['artifact']}"
    header = (
        f"<h1>{escape(title)}</h1><p>Source <code>{escape(source.path)}</code>: "
        f"{escape(source_sentence(source))}; tensorsmith "
        f"{escape(report['tensorsmith_version'])}.</p>"
    )
    sections = [_verdict, _steps, _fusion, _accuracy, _sensitivity, _calibration, _plan, _cpu, _engines]
    body = header + "".join(section(report) for section in sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )
