"""INT8 calibration at scale: tensorsmith's whole compile against ONNX Runtime's `quantize_static`, one run.

    python bench/calibration.py

The same MiniLM ONNX file (a TorchScript export at opset 17, as a user brings one), the same 128 calibration
sentences (samples/minilm/calibration.npz, 64 tokens), each command in its own process, measured as a user meets
it: wall clock including imports, and peak RSS.
- `tensorsmith compile model.onnx --calibration calib.npz --eval-data evaluation.npz --precision int8
  --calibrator entropy -o OUT` (target cpu: the whole compile, report included);
- ONNX Runtime: `quantize_static(CalibrationMethod.Entropy, op_types_to_quantize=["MatMul"])`, QDQ, symmetric
  int8 activations, per-channel weights (without the MatMul restriction it fails on the mask's -inf);
- `tensorsmith calibrate model.onnx --calibration calib.npz -o stats.npz`: the calibration step alone, on the 128
  sentences and on 1,280 (peak RSS should not grow with the data), and as 4 shards on a local Ray, whose merged
  statistics must equal the single process's bit for bit.
Then the embeddings of both int8 models are compared with fp32 on the 64 held-out sentences. Prints markdown for
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
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
LARGE = 1280


def export(path: Path) -> None:
    """MiniLM through the TorchScript exporter at opset 17 (what the issue measured)."""
    import torch

    from tensorsmith.samples.minilm.model import build

    names = ["input_ids", "attention_mask"]
    with np.load(CALIBRATION) as archive:
        example = tuple(torch.from_numpy(archive[name][:2]) for name in names)
    torch.onnx.export(build().eval(), example, str(path), dynamo=False, opset_version=17, input_names=names,
                      output_names=["token_embeddings", "sentence_embedding"],
                      dynamic_axes={name: {0: "batch", 1: "sequence"} for name in names})  # fmt: skip


def docstring_sentences(exclude: set[str]) -> list[str]:
    """More real sentences: the docstrings of the standard library's own sources (read with ast, never imported),
    filtered as samples/sentences.py filters pydoc's topics."""
    import ast
    import re
    import sysconfig

    found: list[str] = []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        for node in nodes:
            text = re.sub(r"\s+", " ", ast.get_docstring(node) or "")
            for sentence in re.split(r"(?<=[.!?])\s+", text):
                words = sentence.split()
                if not 6 <= len(words) <= 40 or not sentence[0].isupper() or re.search(r"[{}<>=|*\[\]]", sentence):
                    continue
                if sentence not in exclude:
                    exclude.add(sentence)
                    found.append(sentence)
    return found


def large_calibration(path: Path) -> None:
    """1,280 sentences: the 128 calibration sentences, pydoc's other topics (none of the evaluation sentences),
    then standard-library docstrings."""
    from tensorsmith.samples.prepare import CALIBRATION_SENTENCES, EVALUATION_SENTENCES, encode
    from tensorsmith.samples.sentences import sentences

    texts = sentences()
    held = CALIBRATION_SENTENCES + EVALUATION_SENTENCES
    chosen = texts[:CALIBRATION_SENTENCES] + texts[held:]
    chosen += docstring_sentences(set(texts))[: LARGE - len(chosen)]
    if len(chosen) < LARGE:
        raise SystemExit(f"only {len(chosen)} sentences available")
    arrays = encode(chosen[:LARGE])
    with np.load(CALIBRATION) as archive:  # the same sequence length as the 128
        length = archive["input_ids"].shape[1]
    np.savez(path, **{name: array[:, :length] for name, array in arrays.items()})


def onnxruntime_side(model: str, output: str) -> None:
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

    quantize_static(model, output, Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.Entropy,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})  # fmt: skip


def measured(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of `command` in a fresh process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise SystemExit(f"{' '.join(command)} failed with status {status}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def cosines(fp32: Path, quantized: Path) -> dict[str, float]:
    import onnxruntime

    with np.load(EVALUATION) as archive:
        feeds = {name: archive[name] for name in archive.files}
    reference = onnxruntime.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(None, feeds)
    actual = onnxruntime.InferenceSession(str(quantized), providers=["CPUExecutionProvider"]).run(None, feeds)
    result = {}
    for name, r, a in zip(("token_embeddings", "sentence_embedding"), reference, actual, strict=True):
        r, a = r.reshape(len(r), -1), a.reshape(len(a), -1)
        result[name] = float(np.mean(np.sum(r * a, axis=1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(a, axis=1))))
    return result


def same_statistics(a: Path, b: Path) -> bool:
    with np.load(a) as first, np.load(b) as second:
        keys = set(first.files) - {"graph_sha256"}
        return keys == set(second.files) - {"graph_sha256"} and all(
            np.array_equal(first[key], second[key]) for key in keys
        )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "onnxruntime":
        onnxruntime_side(sys.argv[2], sys.argv[3])
        return
    tensorsmith = str(Path(sys.executable).with_name("tensorsmith"))
    with tempfile.TemporaryDirectory(prefix="tensorsmith-calibration-") as scratch:
        work = Path(scratch)
        model, large = work / "minilm-opset17.onnx", work / "calibration-1280.npz"
        export(model)
        large_calibration(large)
        compile_command = [tensorsmith, "compile", str(model), "--eval-data", str(EVALUATION), "--precision", "int8",
                           "--calibrator", "entropy"]  # fmt: skip
        figures = {
            "tensorsmith compile --precision int8 (128 sentences)":
                measured([*compile_command, "--calibration", str(CALIBRATION), "-o", str(work / "out")]),
            "ONNX Runtime quantize_static (Entropy, MatMul; 128 sentences)":
                measured([sys.executable, __file__, "onnxruntime", str(model), str(work / "ort.onnx")]),
            "tensorsmith calibrate (the calibration step alone, 128 sentences)":
                measured([tensorsmith, "calibrate", str(model), "--calibration", str(CALIBRATION), "-o",
                          str(work / "stats.npz")]),
            "tensorsmith calibrate (1,280 sentences)":
                measured([tensorsmith, "calibrate", str(model), "--calibration", str(large), "-o",
                          str(work / "stats-1280.npz")]),
            "tensorsmith calibrate --ray --shards 4 (local Ray, 128 sentences)":
                measured([tensorsmith, "calibrate", str(model), "--calibration", str(CALIBRATION), "--ray",
                          "--shards", "4", "-o", str(work / "stats-ray.npz")]),
            "tensorsmith compile --precision int8 (1,280 sentences)":
                measured([*compile_command, "--calibration", str(large), "-o", str(work / "out-1280")]),
        }  # fmt: skip
        ours = cosines(work / "out" / "model.onnx", work / "out" / "variants" / "cpu-int8.onnx")
        theirs = cosines(model, work / "ort.onnx")
        steps = json.loads((work / "out" / "manifest.json").read_text())["steps"]
        ray_equal = same_statistics(work / "stats.npz", work / "stats-ray.npz")

    print(f"{machine()}; MiniLM (TorchScript, opset 17), int8, 64 tokens a sentence; one run\n")
    rows = [[name, f"{wall:.1f}", f"{rss:.0f}"] for name, (wall, rss) in figures.items()]
    print(markdown_table(["command", "wall s", "peak RSS MB"], rows))
    names = list(figures)
    (ours_wall, ours_rss), (ort_wall, ort_rss) = figures[names[0]], figures[names[1]]
    print(f"\ncompile against quantize_static: {ort_wall / ours_wall:.2f}x the speed, {ours_rss / ort_rss:.2f} of "
          f"its peak RSS (goal: 4x, at most 1/3)")  # fmt: skip
    print(f"1,280 against 128 sentences, peak RSS: calibrate {figures[names[3]][1] / figures[names[2]][1]:.3f}x, "
          f"compile {figures[names[5]][1] / ours_rss:.3f}x (goal: within 1.10x)")  # fmt: skip
    print(f"4 Ray shards merged == one process, bit for bit: {ray_equal}\n")
    print(markdown_table(["model", "cosine token_embeddings", "cosine sentence_embedding"],
                         [["tensorsmith cpu-int8", f"{ours['token_embeddings']:.4f}",
                           f"{ours['sentence_embedding']:.4f}"],
                          ["ONNX Runtime quantize_static", f"{theirs['token_embeddings']:.4f}",
                           f"{theirs['sentence_embedding']:.4f}"]]))  # fmt: skip
    print("\ncompile steps (s): " + ", ".join(f"{step['name'][:40]} {step['seconds']:.2f}" for step in steps))


if __name__ == "__main__":
    main()
