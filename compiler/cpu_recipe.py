"""The cpu target's recipe: ONNX Runtime runs TensorRT-style Q/DQ (static activation scales) and its own
dynamic quantization (activation scales computed per call) at different speeds and accuracies, so under
`--precision auto` both are built within the budget and the faster one serves the cpu target.

Dynamic quantization covers MatMuls with constant weights (per-channel int8 weights), the least sensitive first
as ordered by the static search, and is bisected with real evaluations (its error is not the static one).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensorsmith.compiler.metrics import Budget, accuracy
from tensorsmith.compiler.verify import run_onnx
from tensorsmith.runtime.manifest import VariantRecord, sha256_of

logger = logging.getLogger(__name__)

LATENCY_RUNS = 7
DYNAMIC_NAME = "cpu-int8-dynamic"


@dataclass
class DynamicVariant:
    record: VariantRecord
    quantized: list[str]
    achieved: float
    evaluations: int


def _no_preprocessing_advice(record: logging.LogRecord) -> bool:
    """ONNX Runtime's quantizer advises shape-inference pre-processing on the root logger at every call; our
    graphs are canonicalized (shapes inferred) already."""
    return not str(record.msg).startswith("Please consider to run pre-processing")


def _quantize_dynamic(source: Path, output: Path, nodes: list[str]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    root.addFilter(_no_preprocessing_advice)
    try:
        quantize_dynamic(
            str(source), str(output), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes, per_channel=True,
        )  # fmt: skip
    finally:
        root.removeFilter(_no_preprocessing_advice)


def build_dynamic_variant(
    reference_path: Path,
    order: list[str],
    evaluation: dict[str, np.ndarray],
    reference: list[np.ndarray],
    budget: Budget,
    directory: Path,
) -> DynamicVariant | None:
    """The largest prefix of `order` (weight MatMuls, least sensitive first) whose dynamic quantization meets
    `budget`, written to variants/cpu-int8-dynamic.onnx; None if not even one layer fits."""
    path = directory / "variants" / f"{DYNAMIC_NAME}.onnx"
    evaluations = 0
    best: tuple[int, float] | None = None

    def achieved(count: int) -> float:
        nonlocal evaluations
        evaluations += 1
        with tempfile.TemporaryDirectory(prefix="tensorsmith-dynamic-") as scratch:
            trial = Path(scratch) / "trial.onnx"
            _quantize_dynamic(reference_path, trial, order[:count])
            value = budget.measure(reference, run_onnx(trial, evaluation))
            if budget.met(value) and (best is None or count > best[0]):
                trial.replace(path)
            return value

    path.parent.mkdir(exist_ok=True)
    low, high = 0, len(order)
    value = achieved(high)  # the common case: every weight MatMul fits
    if budget.met(value):
        best = (high, value)
    else:
        while low < high:
            middle = (low + high + 1) // 2
            value = achieved(middle)
            if budget.met(value):
                low, best = middle, (middle, value)
            else:
                high = middle - 1
    if best is None or best[0] == 0:
        path.unlink(missing_ok=True)
        return None
    count, value = best
    value = _with_int8_embeddings(path, evaluation, reference, budget, value)
    measured = accuracy(reference, run_onnx(path, evaluation))
    record = VariantRecord(
        name=DYNAMIC_NAME,
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        precisions=["int8", "fp32"],
        accuracy=measured,
    )
    return DynamicVariant(record, order[:count], value, evaluations)


def _with_int8_embeddings(
    path: Path, evaluation: dict[str, np.ndarray], reference: list[np.ndarray], budget: Budget, value: float
) -> float:
    """Store the variant's vocabulary tables in int8 (passes/embeddings.py) if it still meets the budget."""
    from tensorsmith.compiler.ir import load_onnx
    from tensorsmith.compiler.variants import rewrite
    from tensorsmith.passes.embeddings import QuantizeEmbeddings

    trial = path.with_name(f".{path.name}.embeddings")
    (report,) = rewrite(load_onnx(path), [QuantizeEmbeddings(gather_first=True)], trial)
    if not report.changed:
        trial.unlink()
        return value
    smaller = budget.measure(reference, run_onnx(trial, evaluation))
    if not budget.met(smaller):
        trial.unlink()
        return value
    trial.replace(path)
    return smaller


def latency_ms(path: Path, feeds: dict[str, np.ndarray]) -> float:
    """Median ONNX Runtime CPU latency over a few runs (after one warm-up), for choosing a recipe."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    times = []
    for _ in range(LATENCY_RUNS):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)
