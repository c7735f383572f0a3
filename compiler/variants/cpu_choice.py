"""The cpu target's variant, backend and ONNX Runtime session: under a budget, the static Q/DQ variant or ONNX
Runtime's dynamic quantization (cpu_dynamic.py) on whichever cpu backend runs the pair fastest here
(cpu_backend.py); for ONNX Runtime, the optimizers that measure slower on the variant are recorded in the manifest
and switched off by the runtime."""

from __future__ import annotations

import functools
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.calibration.layers import Layer
from tensorsmith.compiler.variants.cpu_backend import MIN_GAIN, fastest_pair, time_cpu_pairs, with_backend
from tensorsmith.compiler.variants.cpu_dynamic import build_dynamic_variant
from tensorsmith.compiler.variants.measure import Evaluation, measure_session, with_text_metrics
from tensorsmith.compiler.variants.precision_plan import CpuChoice, SessionChoice
from tensorsmith.compiler.variants.quantized import flops_fraction
from tensorsmith.core.external_bytes import graph_bytes
from tensorsmith.core.ir import save_onnx
from tensorsmith.core.layerwise import layerwise_segments
from tensorsmith.core.metrics import Budget
from tensorsmith.core.sessions import run_onnx
from tensorsmith.core.timing import cpu_session, latency_ms, latency_ms_in_turn
from tensorsmith.passes import PassReport
from tensorsmith.runtime.backends import ONNX_RUNTIME
from tensorsmith.runtime.manifest import VariantRecord
from tensorsmith.runtime.specs import Signature

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionCandidate:
    """ONNX Runtime graph optimizers to switch off together, and the ops they rewrite: on a graph without any of
    those ops the session is the same either way, and the candidate is not timed."""

    disabled: tuple[str, ...]
    rewrites: frozenset[str]


# Tried one set at a time. ONNX Runtime's CPU SkipLayerNormalization kernel took 3-4x the time of the Adds +
# LayerNormalization it replaces on MiniLM (x86-64 with AVX-512, 1 or 2 threads, batch 1 to 32:
# docs/benchmark-history.md), so whether to fuse is measured; a decoder's RMSNormalization is left as it is
# (checked: Llama-3.2-1B's INT4 variant optimizes to the same graph either way).
# ReduceMean: ONNX Runtime first fuses a norm written as its pieces (an unfused export, `fuse = false`), then skips it.
SESSION_CANDIDATES = (
    SessionCandidate(
        ("SkipLayerNormFusion",), frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "ReduceMean"})
    ),
)
MAX_TUNED_BYTES = 2 << 30  # each candidate's session opens its weights again: not for models above 2 GiB
TIMING_BATCH = 8


def session_label(disabled_optimizers: tuple[str, ...] | list[str]) -> str:
    return "defaults" if not disabled_optimizers else "without " + ", ".join(disabled_optimizers)


def applicable_candidates(path: Path) -> list[tuple[str, ...]]:
    """The disabled-optimizer sets of SESSION_CANDIDATES that change the session of the graph at `path`."""
    ops = {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}
    return [candidate.disabled for candidate in SESSION_CANDIDATES if candidate.rewrites & ops]


def tune_session(path: Path, feeds: dict[str, np.ndarray]) -> tuple[list[str], dict[str, float]]:
    """The ONNX Runtime optimizers to disable for the variant at `path` (the fastest of the candidates that apply
    to it, if it beats the defaults by MIN_GAIN), with every timed candidate's latency ({} where none applies)."""
    candidates: list[tuple[str, ...]] = [(), *applicable_candidates(path)]
    if len(candidates) == 1:
        return [], {}
    measured = latency_ms_in_turn(
        {session_label(disabled): functools.partial(cpu_session, path, disabled) for disabled in candidates}, feeds
    )
    default = measured[session_label(())]
    best = min(candidates, key=lambda disabled: measured[session_label(disabled)])
    if measured[session_label(best)] > default * (1 - MIN_GAIN):
        best = ()
    return list(best), measured


def tuned(variant: VariantRecord, directory: Path, feeds: dict[str, np.ndarray]) -> VariantRecord:
    """`variant` with the ONNX Runtime optimizers that run it slower on this CPU recorded (unchanged for a model
    too large to open a session per candidate; choose_cpu_backend keeps variants measured layerwise from here)."""
    path = directory / variant.path
    if graph_bytes(path) > MAX_TUNED_BYTES:
        logger.info("cpu: ONNX Runtime's defaults kept for %s: too large to open a session per candidate", path.name)
        return variant
    disabled, latency = tune_session(path, feeds)
    if not latency:
        logger.info("cpu: ONNX Runtime's defaults kept for %s: no optimizer to try changes its graph", path.name)
        return variant
    logger.info(
        "cpu: %s ms per run by ONNX Runtime session setting; optimizers switched off: %s", latency, disabled or "none"
    )
    return variant.model_copy(update={"onnxruntime_disabled_optimizers": disabled})


def choose_cpu_backend(
    record: VariantRecord,
    directory: Path,
    feeds: dict[str, np.ndarray],
    specs: Signature,
    time_openvino: bool = True,
) -> VariantRecord:
    """`record` with its ONNX Runtime session settings chosen and the faster cpu backend recorded, with its
    latency on each; `time_openvino=False`: ONNX Runtime only (a graph OpenVINO cannot read). A variant measured
    a layer at a time is not timed: a whole session of it (Llama-3.1-8B's INT4 variant: 10.9 GB for 4.5 GB of
    weights) would hold more than the compile's bound, so it runs on ONNX Runtime, as its accuracy level is chosen."""
    if layerwise_segments(directory / record.path) is not None:
        logger.info("cpu: %s runs on ONNX Runtime, not timed: a whole session of it does not fit here", record.path)
        return with_backend(record, ONNX_RUNTIME.name, {})
    record = tuned(record, directory, feeds)
    times = time_cpu_pairs([record], directory, feeds, specs, time_openvino)
    return with_backend(record, fastest_pair(times)[1], times)


@dataclass(frozen=True)
class CpuOutcome:
    static: VariantRecord  # the static Q/DQ variant's record (session-tuned if it was chosen)
    chosen: VariantRecord  # what the cpu target runs: `static`, or the dynamic variant
    plan: CpuChoice


def choose_cpu_variant(
    source: tuple[onnx.ModelProto, list[PassReport]],
    layers: list[Layer],
    order: list[str],
    static: VariantRecord,
    evaluation: Evaluation,
    budget: Budget,
    directory: Path,
    specs: Signature,
    static_met: bool = True,
) -> CpuOutcome:
    """Build the dynamic-quantization variant within the budget (weight MatMuls, in the search's order) from
    `source` (cpu_dynamic.dynamic_source: the graph and what preparing it did); keep it for cpu if it runs faster
    than the static Q/DQ variant on the fastest cpu backend of each, or if the static one misses the budget
    (`static_met` False). Then, on ONNX Runtime, choose its session settings for the winner."""
    model, prepared = source
    weights = {initializer.name for initializer in model.graph.initializer}
    # The outlier branches' MatMuls are new nodes, not in `order`: they stay in fp32.
    weight_matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    with tempfile.TemporaryDirectory(prefix="tensorsmith-cpu-", dir=directory) as scratch:
        path = Path(scratch) / "source.onnx"
        save_onnx(model, path)
        dynamic = build_dynamic_variant(
            path,
            [name for name in order if name in weight_matmuls],
            evaluation.feeds,
            evaluation.reference,
            budget,
            directory,
        )
    timed = evaluation.timing if evaluation.timing is not None else evaluation.feeds
    batch = {name: array[:TIMING_BATCH] for name, array in timed.items()}
    candidates, reason = [static], "no layer fits the budget with dynamic quantization"
    if dynamic is not None:
        fraction = flops_fraction(layers, set(dynamic.quantized))
        candidate = dynamic.record.model_copy(
            update={
                "accuracy": {**dynamic.record.accuracy, "quantized_flops_fraction": fraction},
                "evaluated_on": evaluation.described,
            }
        )
        if evaluation.tokens is not None:  # a decoder's: perplexity too, as every variant of it has, on one run of
            # every window: dynamic quantization scales each run's activations, so rows would measure another model
            outputs = run_onnx(directory / candidate.path, evaluation.feeds)
            candidate = with_text_metrics(candidate, evaluation, outputs)
        if static_met:
            candidates.append(candidate)
            reason = "fastest within budget"
        else:  # only the dynamic variant holds the budget: timed for its backend, not against the static one
            candidates, reason = [candidate], "the static variant misses the budget, the dynamic one holds it"
    times = time_cpu_pairs(candidates, directory, batch, specs)
    variant, backend = fastest_pair(times)
    chosen = with_backend(next(record for record in candidates if record.name == variant), backend, times)
    for record in candidates[1:]:
        if record.name != chosen.name:
            (directory / record.path).unlink()
    latency = {name: by_backend[ONNX_RUNTIME.name] for name, by_backend in times.items()} if dynamic else {}
    disabled, by_session = tune_session(directory / chosen.path, batch) if backend == ONNX_RUNTIME.name else ([], {})
    chosen = chosen.model_copy(update={"onnxruntime_disabled_optimizers": disabled})
    plan = CpuChoice(
        variant=chosen.name,
        reason=reason,
        latency_ms_batch8=latency,
        latency_ms_by_backend=times if dynamic else {},
        dynamic_preparation={report.name: {**report.counts, **report.details.as_json()} for report in prepared},
        onnxruntime_session=SessionChoice(disabled_optimizers=disabled, latency_ms_batch8=by_session),
    )
    return CpuOutcome(chosen if chosen.name == static.name else static, chosen, plan)


ACCURACY_LEVEL = "session.qdq_matmulnbits_accuracy_level"  # of the MatMulNBits ONNX Runtime fuses INT4 into
ACCURACY_LEVELS = {"1": "fp32 activations", "4": "int8 activations (ONNX Runtime's default)"}
# Without a budget, the int8-activation kernels are taken when the metric moves by at most ACCURACY_TOLERANCE of
# itself, or by at most LOSS_SHARE of the loss the variant already has against fp32 (both default metrics,
# cosine and perplexity-ratio, are 1 for a lossless variant). Their decode step is 3.5x faster (Qwen2.5-3B's
# shape, batch 1): at cosine 0.848 the tolerance alone refused a change of 0.0009 (docs/benchmarks.md).
ACCURACY_TOLERANCE = 1e-3
LOSS_SHARE = 0.05
LOSSLESS = 1.0  # cosine's and perplexity-ratio's value for a variant equal to fp32
DEFAULT_ACCURACY_LEVEL = "4"  # what a session without the setting runs: the level build_int4_variant measured


def choose_accuracy_level(
    record: VariantRecord, directory: Path, evaluation: Evaluation
) -> tuple[VariantRecord, CpuChoice]:
    """An INT4 cpu variant's MatMulNBits accuracy level, by measurement: the int8-activation kernels when they are
    faster (by MIN_GAIN) and the budget still holds (without one: `within_tolerance`), else fp32 activations. The
    record's accuracy is the chosen level's.

    Each level is measured a few rows at a time (measure.py); the default level's figures are the record's own
    where they hold the metric (build_int4_variant measured them)."""
    path = directory / record.path
    if layerwise_segments(path) is not None:  # measured a layer at a time: a whole session per level would not fit
        level = DEFAULT_ACCURACY_LEVEL
        reason = (
            f"accuracy level {level} ({ACCURACY_LEVELS[level]}), ONNX Runtime's default, not timed: "
            f"{path.name} is measured a layer at a time (a session per level does not fit here)"
        )
        updated = record.model_copy(update={"onnxruntime_session_config": {ACCURACY_LEVEL: level}})
        return updated, CpuChoice(variant=record.name, reason=reason)
    timed = evaluation.timing if evaluation.timing is not None else evaluation.feeds
    batch = {name: array[:TIMING_BATCH] for name, array in timed.items()}
    # one session at a time, timed and measured before the next opens: each holds the variant's weights and
    # MatMulNBits' packed copy (at the 8B shape, two at once held 18 GB)
    latency: dict[str, float] = {}
    figures: dict[str, dict[str, float]] = {}
    for level in ACCURACY_LEVELS:
        session = cpu_session(path, config={ACCURACY_LEVEL: level})
        latency.update(latency_ms({level: session}, batch))
        known = level == DEFAULT_ACCURACY_LEVEL and _metric_name(evaluation) in record.accuracy
        figures[level] = dict(record.accuracy) if known else measure_session(session, evaluation)
        del session
    metric = {level: figures[level][_metric_name(evaluation)] for level in ACCURACY_LEVELS}
    fast, exact = "4", "1"
    faster = latency[fast] < latency[exact] * (1 - MIN_GAIN)
    if evaluation.budget is not None:
        holds = evaluation.budget.met(metric[fast])
    else:
        holds = within_tolerance(metric[fast], metric[exact])
    chosen = fast if faster and holds else exact
    reason = f"accuracy level {chosen} ({ACCURACY_LEVELS[chosen]}): " + (
        ("faster within the budget" if evaluation.budget is not None else "faster, the metric within tolerance")
        if chosen == fast
        else "the int8-activation kernels " + ("were not faster" if not faster else "moved the metric too far")
    )
    updated = record.model_copy(
        update={"onnxruntime_session_config": {ACCURACY_LEVEL: chosen}, "accuracy": figures[chosen]}
    )
    by_level = {f"accuracy level {level}": value for level, value in latency.items()}
    measured = {f"accuracy level {level}": value for level, value in metric.items()}
    plan = CpuChoice(
        variant=record.name, reason=reason, latency_ms_batch8=by_level, metric={_metric_name(evaluation): measured}
    )
    return updated, plan


def within_tolerance(fast: float, exact: float) -> bool:
    """Whether a faster kernel's metric (cosine or perplexity-ratio, no budget given) is close enough to the exact
    kernel's: within ACCURACY_TOLERANCE of it, or within LOSS_SHARE of the exact kernel's own loss."""
    allowed = max(ACCURACY_TOLERANCE * abs(exact), LOSS_SHARE * abs(LOSSLESS - exact))
    return abs(fast - exact) <= allowed


def _metric_name(evaluation: Evaluation) -> str:
    """The budget's metric, else perplexity-ratio for a decoder's text, else cosine."""
    if evaluation.budget is not None:
        return evaluation.budget.metric
    return "perplexity-ratio" if evaluation.tokens is not None else "cosine"
