"""`[generation] kv_cache_precision = "fp8"`: the engines' static cache in FLOAT8E4M3FN, measured by perplexity.

Each layer's keys and values get one per-tensor scale, amax / 448 of the cache's values on the fp32 graph (its
presents, a prefill of a few windows of the calibration text, else of the evaluation text, else the verification
feeds). The variant an engine is built from is measured with the fp8 rounding simulated on its dynamic graph
(QuantizeLinear → DequantizeLinear before each Concat, on ONNX Runtime's CPU provider) on the evaluation text the
variants are measured on; its record gets `kv_fp8_perplexity`, `kv_fp8_perplexity-ratio` (over the fp32 graph)
and `kv_fp8_next-token-agreement`. Then its generation graph's caches become fp8 (passes/kv_quantize.py).

TensorRT refuses that graph: its KV-cache update (the layer TensorScatter becomes, which aliases present to past)
takes no fp8 cache. tensorrt-rtx 1.7.1 says, for sm_89 and sm_120 alike, `TENSORRT_REFUSAL`; data-centre
TensorRT (sm_90, sm_100) builds on a matching GPU only and is not verified. So the option is refused before the
export (`ENGINES_TAKE_FP8_CACHE`), with that reason, and nothing half-works; the measurement and the rewrite
stay, tested with the gate lifted (tests/compiler/test_kv_cache_precision.py), for the TensorRT that takes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.targets import get_target
from tensorsmith.compiler.variants.language import TextEvaluation
from tensorsmith.compiler.variants.text_data import prefill_feeds, token_windows, window_length
from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.core.ir import load_onnx
from tensorsmith.core.language import language_model_metrics
from tensorsmith.core.precisions import FP8
from tensorsmith.core.sessions import run_onnx
from tensorsmith.passes import run_passes
from tensorsmith.passes.kv_quantize import QuantizedCache, fp8_scale
from tensorsmith.runtime.manifest import TensorRecord, VariantRecord

logger = logging.getLogger(__name__)

FP8_CACHE = FP8.name
SCALE_WINDOWS = 8  # windows of text the scales' amax is taken over
PREFIX = "kv_fp8_"
ENGINES_TAKE_FP8_CACHE = False  # lift once TensorRT's KV-cache update takes an fp8 cache
TENSORRT_REFUSAL = "cache has type FP8 but must have type Float, Half, or BFloat16"


def check_cache_precision(config: CompileConfig) -> None:
    """`--kv-cache-precision fp8` refused before the export: it needs the static cache and GPU targets that run
    fp8 (sm_89 and later), every GPU target of the compile."""
    if config.generation.kv_cache_precision != FP8_CACHE:
        return
    gpu = [name for name in config.targets if get_target(name).builders]
    slow = [name for name in gpu if not get_target(name).runs_precision(FP8)]
    reason, hint = (
        ("--kv-cache dynamic keeps the cache in the variant's dtype", "drop --kv-cache dynamic")
        if config.generation.kv_cache == "dynamic"
        else (
            f"no GPU target among {', '.join(config.targets)} (the cpu variant's cache is fp32)",
            "add a GPU target of sm_89 or later",
        )
        if not gpu
        else (f"{', '.join(slow)} cannot run fp8 (sm_89 and later can)", "drop those targets or the option")
        if slow
        else (
            f'TensorRT\'s KV-cache update takes no fp8 cache (tensorrt-rtx 1.7: "{TENSORRT_REFUSAL}")',
            "drop the option: the cache stays in the engine's dtype (fp16)",
        )
        if not ENGINES_TAKE_FP8_CACHE
        else (None, None)
    )
    if reason:
        raise ConfigError(f"generation.kv_cache_precision = fp8: {reason}", hint=hint)


def cache_scales(
    config: CompileConfig,
    reference: Path,
    inputs: list[TensorRecord],
    verification: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, float], str]:
    """Each present's scale (name → amax / 448) on the fp32 graph, and what it was measured on."""
    text = config.calibration if config.calibration is not None else config.evaluation
    if text is not None:
        path = config.resolve(text)
        tokens = token_windows(config, path, window_length(config), SCALE_WINDOWS)
        feeds, described = prefill_feeds(tokens, inputs), f"{len(tokens)} windows of {path.name}"
    else:
        feeds, described = verification(), "the verification feeds"
    names = [output.name for output in onnx.load(str(reference), load_external_data=False).graph.output]
    values = run_onnx(reference, feeds)
    scales = {
        name: fp8_scale(float(np.abs(value).max()))
        for name, value in zip(names, values, strict=True)
        if name.startswith("present.")
    }
    return scales, described


def with_fp8_perplexity(
    record: VariantRecord, reference: Path, directory: Path, evaluation: TextEvaluation | None, scales: dict[str, float]
) -> VariantRecord:
    """`record` with the fp8 cache's language-model metrics added (`kv_fp8_…`), simulated on its dynamic graph."""
    if evaluation is None:
        logger.warning(
            "%s: the fp8 KV cache is not measured: the compile has no evaluation text (--eval-data)", record.name
        )
        return record
    graph = gs.import_onnx(load_onnx(directory / record.path))
    run_passes(graph, [QuantizedCache(scales, simulate=True)])
    try:
        actual = run_onnx(gs.export_onnx(graph), evaluation.feeds)[0]
    except ExportError as err:
        logger.warning("%s: the fp8 KV cache is not measured: %s", record.name, err)
        return record
    expected = run_onnx(reference, evaluation.feeds)[0]
    measured = {
        f"{PREFIX}{key}": value for key, value in language_model_metrics(evaluation.tokens, expected, actual).items()
    }
    logger.info(
        "%s: fp8 KV cache perplexity %.4f (ratio %.4f over fp32; the variant's own cache: %s)",
        record.name,
        measured[f"{PREFIX}perplexity"],
        measured[f"{PREFIX}perplexity-ratio"],
        record.accuracy.get("perplexity", "not measured"),
    )
    return record.model_copy(update={"accuracy": {**record.accuracy, **measured}})
