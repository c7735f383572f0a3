"""INT8 calibration: tensorsmith against ONNX Runtime's `quantize_static`, same model and data, one run.

    python bench/calibration.py [--artifact build/minilm] [--repeats 3]

Both calibrate MiniLM's fused fp32 graph (`tensorsmith compile samples/minilm/tensorsmith.toml -o build/minilm`)
on the 128 calibration sentences (seq 64, batches of 16) and write an int8 Q/DQ model:
- tensorsmith: two streaming passes, TensorRT's entropy thresholds, per-channel int8 weights;
- ONNX Runtime: `quantize_static(CalibrationMethod.Entropy, op_types_to_quantize=["MatMul"])`, QDQ, int8
  symmetric activations and per-channel weights (without the MatMul restriction it fails on the mask's -inf).
Each side runs in its own process, measured for wall time and peak RSS; then the embeddings of both int8
models are compared with fp32 on the 64 held-out sentences. Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.runner import machine, markdown_table  # noqa: E402

CALIBRATION = ROOT / "samples" / "minilm" / "calibration.npz"
EVALUATION = ROOT / "samples" / "minilm" / "evaluation.npz"
BATCH = 16


def ours(model_path: Path, output: Path) -> None:
    import onnx
    import onnx_graphsurgeon as gs

    from tensorsmith.calibration import CalibrationData, calibrate
    from tensorsmith.passes import run_passes
    from tensorsmith.passes.quantize import InsertQDQ
    from tensorsmith.runtime.specs import TensorSpec

    model = onnx.load(str(model_path))
    specs = [TensorSpec(name, "int64", ("batch", "sequence")) for name in ("input_ids", "attention_mask")]
    table = calibrate(model, CalibrationData(CALIBRATION, specs, batch_size=BATCH), "entropy")
    graph = gs.import_onnx(model)
    run_passes(graph, [InsertQDQ("int8", table.int8_scales())])
    onnx.save(gs.export_onnx(graph), str(output))


def onnxruntime_side(model_path: Path, output: Path) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            with np.load(CALIBRATION) as archive:
                data = {name: archive[name] for name in archive.files}
            count = len(data["input_ids"])
            self.batches = iter([{k: v[i : i + BATCH] for k, v in data.items()} for i in range(0, count, BATCH)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quantize_static(
        str(model_path),
        str(output),
        Reader(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.Entropy,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )


def measured_run(side: str, model_path: Path, output: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one side in a fresh process."""
    command = [sys.executable, __file__, "--side", side, "--model", str(model_path), "--output", str(output)]
    started = time.perf_counter()
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"{side} failed with status {status}")
    return wall, usage.ru_maxrss / 1024


def cosine_against_fp32(fp32: Path, quantized: Path) -> tuple[float, float]:
    import onnxruntime

    with np.load(EVALUATION) as archive:
        feeds = {name: archive[name] for name in archive.files}

    def embeddings(path: Path) -> np.ndarray:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(["sentence_embedding"], feeds)[0]

    reference, actual = embeddings(fp32), embeddings(quantized)
    cosine = np.sum(reference * actual, axis=1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(actual, axis=1))
    return float(cosine.mean()), float(cosine.min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=ROOT / "build" / "minilm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side", choices=["tensorsmith", "onnxruntime"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a measured child process
        (ours if args.side == "tensorsmith" else onnxruntime_side)(args.model, args.output)
        return

    model_path = args.artifact / "model.onnx"
    rows = []
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        outputs = {side: Path(scratch) / f"{side}.onnx" for side in ("tensorsmith", "onnxruntime")}
        for _ in range(args.repeats):
            for side, output in outputs.items():  # interleaved, so drift hits both
                wall, rss = measured_run(side, model_path, output)
                results.setdefault(side, {"wall": [], "rss": []})
                results[side]["wall"].append(wall)
                results[side]["rss"].append(rss)
        for side, output in outputs.items():
            mean, worst = cosine_against_fp32(model_path, output)
            wall, rss = statistics.median(results[side]["wall"]), statistics.median(results[side]["rss"])
            rows.append([side, f"{wall:.1f}", f"{rss:.0f}", f"{mean:.4f}", f"{worst:.4f}"])
    ours_wall = statistics.median(results["tensorsmith"]["wall"])
    theirs_wall = statistics.median(results["onnxruntime"]["wall"])
    ours_rss = statistics.median(results["tensorsmith"]["rss"])
    theirs_rss = statistics.median(results["onnxruntime"]["rss"])
    print(f"{machine()}; MiniLM int8, 128 calibration sentences × 64 tokens; median of {args.repeats} runs\n")
    header = ["calibrator", "wall s", "peak RSS MB", "cosine vs fp32 (mean)", "cosine (min)"]
    print(markdown_table(header, rows))
    print(f"\nspeed-up {theirs_wall / ours_wall:.1f}x, memory {ours_rss / theirs_rss:.2f} of ONNX Runtime's")


if __name__ == "__main__":
    main()
