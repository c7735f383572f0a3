"""Fusion on real exports: tensorsmith's passes against ONNX Runtime's transformer optimizer, in one run.

    python bench/fusion.py [--repeats 3]

For each export (MiniLM and tiny_bert, TorchScript at opsets 14 and 17, dynamo at 18 and 20) it runs
- tensorsmith: canonicalize (to opset 20) + fuse + fold_attention_scale;
- ONNX Runtime: `onnxruntime.transformers.optimizer.optimize_model(model_type="bert", opt_level=0)`, its
  Python fusions only, as users run it before TensorRT;
and reports fused op counts, pass time (median of --repeats, interleaved), the outputs' error against the
unfused export on ONNX Runtime, and whether TensorRT for RTX parses and builds the result for SM86.
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runner import machine, markdown_table

SAMPLES = {"minilm": (12, 384), "tiny_bert": (4, 64)}  # heads, hidden
EXPORTS = [("torchscript", 14), ("torchscript", 17), ("dynamo", 18), ("dynamo", 20)]
COUNTED = (
    "LayerNormalization",
    "SkipLayerNormalization",
    "EmbedLayerNormalization",
    "Gelu",
    "FastGelu",
    "BiasGelu",
    "Attention",
    "Erf",
)


def export(name: str, exporter: str, opset: int, path: Path) -> dict[str, np.ndarray]:
    import torch

    from tensorsmith.compiler import CompileConfig
    from tensorsmith.compiler.frontend.export import _build_module
    from tensorsmith.compiler.frontend.exporters import export_dynamo, export_torchscript
    from tensorsmith.samples import prepare

    prepare.prepare(name)
    config = CompileConfig.from_toml(prepare.SAMPLES / name / "tensorsmith.toml", opset=opset)
    module = _build_module(config)
    with np.load(prepare.SAMPLES / "minilm" / "evaluation.npz") as held_out:
        feeds = {key: held_out[key][:8] for key in held_out.files}
    if name == "tiny_bert":
        feeds["input_ids"] = feeds["input_ids"] % 1000
    example = {key: value[:2, :16] for key, value in feeds.items()}
    with torch.inference_mode():
        exporter_function = export_dynamo if exporter == "dynamo" else export_torchscript
        model = exporter_function(module, config, example, config.outputs or None, [])
    import onnx

    onnx.save(model, str(path))
    return feeds


def run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def error(reference: list[np.ndarray], actual: list[np.ndarray]) -> float:
    from tensorsmith.core.metrics import relative_error

    return max(relative_error(r, a) for r, a in zip(reference, actual, strict=True))


def tensorsmith_fuse(source: Path, target: Path) -> tuple[float, float]:
    """(canonicalize seconds, fusion seconds): the first includes the opset upgrade ORT's optimizer skips."""
    import onnx
    import onnx_graphsurgeon as gs

    from tensorsmith.passes import Canonicalize, default_passes, run_passes

    model = onnx.load(str(source))
    started = time.perf_counter()
    model, _ = Canonicalize(opset=20)(model)
    canonical = time.perf_counter()
    graph = gs.import_onnx(model)
    run_passes(graph, default_passes())
    fused = gs.export_onnx(graph)
    finished = time.perf_counter()
    onnx.save(fused, str(target))
    return canonical - started, finished - canonical


def onnxruntime_fuse(source: Path, target: Path, heads: int, hidden: int) -> float:
    from onnxruntime.transformers.optimizer import optimize_model

    started = time.perf_counter()
    optimized = optimize_model(str(source), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0)
    seconds = time.perf_counter() - started
    optimized.save_model_to_file(str(target))
    return seconds


def tensorrt_builds(path: Path, inputs: dict[str, np.ndarray]) -> str:
    from tensorsmith.compiler.engines.builder import build_engine
    from tensorsmith.compiler.engines.profiles import Profile
    from tensorsmith.core.errors import BuildError

    shapes = {name: ((1, 1), tuple(value.shape), (16, 128)) for name, value in inputs.items()}
    try:
        build_engine(path, "sm_86", Profile(shapes))  # type: ignore[arg-type]
    except BuildError as err:
        failed = sorted(set(re.findall(r"\((\w+)\)", err.message)))
        return f"no: cannot import {', '.join(failed)}"
    return "yes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", nargs="*", default=list(SAMPLES))
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # TensorRT's parse errors on ORT's contrib ops are expected
    import onnx

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.samples:
            heads, hidden = SAMPLES[name]
            for exporter, opset in EXPORTS:
                source = Path(scratch) / f"{name}-{exporter}-{opset}.onnx"
                feeds = export(name, exporter, opset, source)
                reference = run(source, feeds)
                ours, theirs = Path(scratch) / "ours.onnx", Path(scratch) / "theirs.onnx"
                times: dict[str, list[float]] = {"canonicalize": [], "ours": [], "theirs": []}
                for _ in range(args.repeats):
                    canonicalize, fuse = tensorsmith_fuse(source, ours)
                    times["canonicalize"].append(canonicalize)
                    times["ours"].append(fuse)
                    times["theirs"].append(onnxruntime_fuse(source, theirs, heads, hidden))
                for label, path in (("tensorsmith", ours), ("onnxruntime", theirs)):
                    counts = Counter(node.op_type for node in onnx.load(str(path)).graph.node)
                    fused = ", ".join(f"{op} {counts[op]}" for op in COUNTED if counts[op]) or "-"
                    key = "ours" if label == "tensorsmith" else "theirs"
                    canonicalize_time = f"{statistics.median(times['canonicalize']):.2f}" if key == "ours" else "-"
                    rows.append(
                        [
                            f"{name} {exporter} {opset}",
                            label,
                            fused,
                            canonicalize_time,
                            f"{statistics.median(times[key]):.2f}",
                            f"{error(reference, run(path, feeds)):.1e}",
                            tensorrt_builds(path, feeds),
                        ]
                    )
    print(f"{machine()}; pass time = median of {args.repeats} interleaved runs\n")
    header = [
        "export",
        "fused by",
        "ops after",
        "canonicalize s",
        "fusion s",
        "max rel. error",
        "TensorRT-RTX SM86 builds",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
