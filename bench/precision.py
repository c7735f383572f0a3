"""MiniLM on the CPU: tensorsmith's cpu variant against ONNX Runtime fp32, static INT8 and dynamic INT8; and
the Q/DQ variants for TensorRT against TensorRT Model Optimizer's ONNX PTQ, in accuracy.

    python bench/precision.py [--auto build/minilm-auto] [--fp32 build/minilm] [--repeats 30]
                              [--modelopt-site build/modelopt-site]

`--auto` is an artifact compiled with `--precision auto --budget 'cosine>=0.995' --eval-data
samples/minilm/evaluation.npz --target cpu` (its cpu target's variant is measured). ONNX Runtime's INT8
models are made here from the same fp32 graph: `quantize_static` (MatMul only, Entropy, QDQ, the 128
calibration sentences) and `quantize_dynamic` (int8 weights). Latency: batch 8 × 64 tokens, 2 intra-op
threads, interleaved runs. Accuracy on the 64 held-out sentences: sentence-embedding cosine against fp32, and
nearest-neighbour agreement (each sentence's nearest other sentence is the same as with fp32), and the token
embeddings' cosine (the other output, which the compile's budget also holds). Our variant runs with the ONNX
Runtime settings its manifest records (the optimizers its compile measured slower); when there are any, ONNX
Runtime's dynamic model is also measured with them.

Second table, accuracy only: TensorRT Model Optimizer's ONNX PTQ (`modelopt.onnx.quantization.quantize`, int8
and fp8, entropy calibration on the same 128 sentences, float regions fp32) against the artifact's int8 and fp8
variants. Both are Q/DQ graphs for TensorRT; ONNX Runtime computes their outputs here, but its CPU time is not
their speed on a GPU, so none is given. Model Optimizer comes from `bash bench/modelopt-site.sh` (its wheel
without the CUDA torch it would pull); without that folder the table is left out. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.runner import compare, machine, markdown_table  # noqa: E402

CALIBRATION = ROOT / "samples" / "minilm" / "calibration.npz"
EVALUATION = ROOT / "samples" / "minilm" / "evaluation.npz"
OUTPUTS = ["token_embeddings", "sentence_embedding"]


def load_feeds(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


def onnxruntime_static(fp32: Path, output: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            data = load_feeds(CALIBRATION)
            self.batches = iter([{k: v[i : i + 16] for k, v in data.items()} for i in range(0, 128, 16)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quantize_static(
        str(fp32), str(output), Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
        calibrate_method=CalibrationMethod.Entropy,
    )  # fmt: skip


def onnxruntime_dynamic(fp32: Path, output: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32), str(output), weight_type=QuantType.QInt8)


def onnxruntime_dynamic_per_channel(fp32: Path, output: Path) -> None:
    """The configuration that reaches the issue's quoted 0.993: MatMul only, per-channel int8 weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32), str(output), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                     per_channel=True)  # fmt: skip


def modelopt_ptq(fp32: Path, output: Path, mode: str) -> None:
    """TensorRT Model Optimizer's ONNX PTQ with its defaults for `mode` (entropy calibration), on the CPU."""
    from modelopt.onnx.quantization import quantize

    with np.load(CALIBRATION) as archive:
        data = {name: archive[name] for name in archive.files}
    quantize(str(fp32), quantize_mode=mode, calibration_data=data, calibration_eps=["cpu"], output_path=str(output),
             high_precision_dtype="fp32", log_level="WARNING")  # fmt: skip


def session(path: Path, disabled_optimizers: list[str]):  # type: ignore[no-untyped-def]
    """2 threads that stop spinning after each run (core.timing.cpu_session), else the idle spinning threads of
    one model's session slow the next one measured: every figure doubled on 2 cores."""
    from tensorsmith.core.timing import cpu_session

    return cpu_session(path, disabled_optimizers, threads=2)


def cosines(reference: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per-sample cosine over everything the sample's output holds (all tokens for token embeddings)."""
    reference, actual = reference.reshape(len(reference), -1), actual.reshape(len(actual), -1)
    return np.sum(reference * actual, axis=1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(actual, axis=1))


def neighbours(embeddings: np.ndarray) -> np.ndarray:
    normed = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    similarity = normed @ normed.T
    np.fill_diagonal(similarity, -np.inf)
    return np.argmax(similarity, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--auto", type=Path, default=ROOT / "build" / "minilm-auto")
    parser.add_argument("--fp32", type=Path, default=ROOT / "build" / "minilm")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--modelopt-site", type=Path, default=ROOT / "build" / "modelopt-site")
    args = parser.parse_args()

    manifest = json.loads((args.auto / "manifest.json").read_text())
    cpu = next(target for target in manifest["targets"] if target["name"] == "cpu")
    variant = next(v for v in manifest["variants"] if v["name"] == cpu["variant"])
    ours, tuned = args.auto / variant["path"], variant.get("onnxruntime_disabled_optimizers", [])
    fp32 = args.fp32 / "model.onnx"
    evaluation = load_feeds(EVALUATION)
    batch = {name: array[:8] for name, array in evaluation.items()}
    without = f", without {', '.join(tuned)}" if tuned else ""
    with tempfile.TemporaryDirectory() as scratch:
        static, dynamic = Path(scratch) / "static.onnx", Path(scratch) / "dynamic.onnx"
        per_channel = Path(scratch) / "dynamic-per-channel.onnx"
        onnxruntime_static(fp32, static)
        onnxruntime_dynamic(fp32, dynamic)
        onnxruntime_dynamic_per_channel(fp32, per_channel)
        models: dict[str, tuple[Path, list[str]]] = {
            "onnxruntime fp32": (fp32, []),
            "onnxruntime static int8 (MatMul, entropy)": (static, []),
            "onnxruntime dynamic int8": (dynamic, []),
            "onnxruntime dynamic int8 (MatMul, per-channel)": (per_channel, []),
        }
        if tuned:  # the same session settings for the anchor, so the table shows what they alone are worth
            models[f"onnxruntime dynamic int8 (MatMul, per-channel){without}"] = (per_channel, tuned)
        models[f"tensorsmith cpu variant ({cpu['variant']}, auto{without})"] = (ours, tuned)
        sessions = {name: session(path, disabled) for name, (path, disabled) in models.items()}
        outputs = {name: s.run(OUTPUTS, evaluation) for name, s in sessions.items()}
        timings, ratios = compare(
            {name: (lambda s=s: s.run(None, batch)) for name, s in sessions.items()}, repeats=args.repeats
        )
        reference = outputs["onnxruntime fp32"]
        rows = [
            [name, timings[name].summary(), f"{ratios.get(name, 1.0):.2f}",
             *accuracy_cells(reference, outputs[name], path)]
            for name, (path, _) in models.items()
        ]  # fmt: skip
    print(f"{machine()}; MiniLM, batch 8 × 64 tokens, 2 threads, {args.repeats} interleaved runs\n")
    header = ["model", "ms min / median / max", "latency vs fp32", "cosine mean", "cosine min", "token cosine",
              "NN agreement", "MB"]  # fmt: skip
    print(markdown_table(header, rows))
    if args.modelopt_site.is_dir():
        print("\nQ/DQ models for TensorRT, accuracy computed by ONNX Runtime on the 64 held-out sentences\n")
        rows = tensorrt_accuracy(args.auto, fp32, reference, evaluation, args.modelopt_site)
        print(markdown_table(["model", "cosine mean", "cosine min", "token cosine", "NN agreement", "MB"], rows))


def accuracy_cells(reference: list[np.ndarray], outputs: list[np.ndarray], path: Path) -> list[str]:
    """Sentence cosine (mean, min), token cosine, nearest-neighbour agreement, MB: `outputs` (token embeddings,
    sentence embedding) of the model at `path` against fp32's `reference`."""
    (reference_tokens, reference_sentences), (tokens, sentences) = reference, outputs
    cosine = cosines(reference_sentences, sentences)
    agreement = float(np.mean(neighbours(sentences) == neighbours(reference_sentences)))
    return [
        f"{cosine.mean():.4f}", f"{cosine.min():.4f}", f"{cosines(reference_tokens, tokens).mean():.4f}",
        f"{agreement:.0%}", f"{path.stat().st_size / 1e6:.0f}",
    ]  # fmt: skip


def accuracy_row(name: str, path: Path, reference: list[np.ndarray], evaluation: dict[str, np.ndarray]) -> list[str]:
    return [name, *accuracy_cells(reference, session(path, []).run(OUTPUTS, evaluation), path)]


def tensorrt_accuracy(
    artifact: Path, fp32: Path, reference: list[np.ndarray], evaluation: dict[str, np.ndarray], site: Path
) -> list[list[str]]:
    sys.path.append(str(site))  # after .venv's packages: its onnx and onnxruntime are the ones used
    manifest = json.loads((artifact / "manifest.json").read_text())
    variants = {variant["name"]: artifact / variant["path"] for variant in manifest["variants"]}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in ("int8", "fp8"):
            quantized = Path(scratch) / f"modelopt-{mode}.onnx"
            modelopt_ptq(fp32, quantized, mode)
            rows.append(accuracy_row(f"TensorRT Model Optimizer ONNX PTQ {mode}", quantized, reference, evaluation))
            if mode in variants:
                rows.append(accuracy_row(f"tensorsmith {mode} variant (auto)", variants[mode], reference, evaluation))
    return rows


if __name__ == "__main__":
    main()
