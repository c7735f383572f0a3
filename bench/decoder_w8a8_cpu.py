"""A decoder's W8A8 layers on ONNX Runtime's CPU: tinylm's cpu-int4 variant with the GPU variant's W8A8 int8 layers
against the same layers weight-only (what compiler/variants/weight_mix.py's recipe_levels stores), a decode step at
batch 1 over a 127-token cache, interleaved, median of 200 each.

    python bench/decoder_w8a8_cpu.py

It compiles samples/tinylm with `--precision auto --budget 'perplexity-ratio<=1.03' --target cpu --target sm_89`
(fp8 layers of the GPU variant are taken as int8 here: the cpu cannot run fp8).
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.int4 import build_int4_variant, plan_int4
from tensorsmith.compiler.variants.measure import Evaluation
from tensorsmith.compiler.variants.rewrite import rewritten
from tensorsmith.compiler.variants.weight_mix import recipe_levels
from tensorsmith.core.precisions import FP32, INT4
from tensorsmith.core.progress import LogReporter
from tensorsmith.core.sessions import run_onnx
from tensorsmith.passes.int4 import GemmAsMatMul
from tensorsmith.runtime.backends import ONNX_RUNTIME
from tensorsmith.runtime.manifest import read_manifest

ROOT = Path(__file__).resolve().parent.parent
TINYLM = ROOT / "samples" / "tinylm"


def main() -> None:
    import pydoc_data.topics

    with tempfile.TemporaryDirectory(prefix="tensorsmith-w8a8-") as scratch:
        work = Path(scratch)
        text = work / "calibration.txt"
        text.write_text("\n".join(list(pydoc_data.topics.topics.values())[:60]), encoding="utf-8")
        art = work / "auto"
        subprocess.run([str(Path(sys.executable).with_name("tensorsmith")), "compile", str(TINYLM / "checkpoint"), "-o",
                        str(art), "--target", "cpu", "--target", "sm_89", "--precision", "auto", "--budget",
                        "perplexity-ratio<=1.03", "--calibration", str(text), "--calibration-samples", "32",
                        "--eval-data", str(TINYLM / "heldout.txt")], check=True, capture_output=True)  # fmt: skip
        measure(art, work)


def measure(art: Path, work: Path) -> None:
    gpu = {layer["name"]: layer["precision"]
           for layer in json.loads((art / "precision.json").read_text())["recipes"]["int4"]["layers"]}  # fmt: skip
    levels = {name: "int8" if level == "fp8" else level for name, level in gpu.items()}
    table = json.loads((art / "calibration.json").read_text())
    scales = {name: t["int8_scale"] for name, t in table["tensors"].items() if t["quantize"]}
    model, _ = rewritten(onnx.load(art / "model.onnx"), [GemmAsMatMul()])
    plan = plan_int4(model, "rtn", 128, None, LogReporter())
    manifest = read_manifest(art)
    rng = np.random.default_rng(0)
    step = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, 128), np.int64),
            "position_ids": np.array([[127]], np.int64)}  # fmt: skip
    for record in manifest.inputs:
        if record.name.startswith("past"):
            step[record.name] = rng.standard_normal((1, record.shape[1], 127, record.shape[3])).astype(np.float32)
    evaluation = Evaluation(step, run_onnx(art / "model.onnx", step), None, "one decode step")
    cpu = Recipe(INT4, FP32, ONNX_RUNTIME)
    paths = {}
    for name, assignment in (("with W8A8 layers", levels), ("weight-only (recipe_levels)", recipe_levels(cpu, levels))):
        folder = work / str(len(paths))
        folder.mkdir()
        record, _ = build_int4_variant(model, cpu, plan, evaluation, folder, assignment, True, {"int8": scales})
        paths[name] = folder / record.path
    sessions = {k: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(5):
        for session in sessions.values():
            session.run(None, step)
    for _ in range(200):
        for name, session in sessions.items():
            started = time.perf_counter()
            session.run(None, step)
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    w8a8 = sum(1 for level in levels.values() if level == "int8")
    print(f"{w8a8} W8A8 layers of {len(levels)}; decode step, batch 1, past 127, median ms of 200:")
    for name, value in medians.items():
        print(f"  {name}: {value:.3f} ms")
    first, second = medians.values()
    print(f"  ratio: {first / second:.2f}x")


if __name__ == "__main__":
    main()
