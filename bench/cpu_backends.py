"""MiniLM on the CPU: OpenVINO against ONNX Runtime, on the artifact's fp32 graph, on NNCF's own int8 (what an
OpenVINO user would pick) and on the artifact's cpu variants, each model in its own process.

    python bench/cpu_backends.py [--int8 build/minilm-int8] [--auto build/minilm-auto] [--runs 50] [--threads 2]

`--int8`: an artifact compiled with `--precision int8 --calibration samples/minilm/calibration.npz --target
cpu` (cpu variant cpu-int8, Q/DQ); `--auto`: one compiled with `--precision auto --budget 'cosine>=0.995'
--calibration ... --eval-data samples/minilm/evaluation.npz --target cpu` (ONNX Runtime's dynamic quantization
ops when it chooses cpu-int8-dynamic). Either is compiled here into a scratch folder when not given. NNCF's
model: `nncf.quantize` (model type transformer, its defaults otherwise) of the fp32 graph read by OpenVINO, on
the 128 calibration sentences, saved as OpenVINO IR. The artifacts' cpu variants run on ONNX Runtime through
`tensorsmith.runtime.load(..., backend="onnxruntime")` (the manifest's session settings) and on OpenVINO.

Per model, in a fresh process pinned to `--threads` cores: load time, then on batch 8 × 64 tokens of
samples/minilm/evaluation.npz `--runs` timed runs after 5 warm-up runs (min / median / max ms), then the 64
held-out sentences in batches of 8: the sentence-embedding cosine (mean, min) and the token embeddings' cosine
against ONNX Runtime fp32; and the process's peak RSS. OpenVINO: `PERFORMANCE_HINT=LATENCY`,
`INFERENCE_NUM_THREADS=--threads`, f32 inference precision. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# Run as a script: the repository root on sys.path (for `bench.`), this file's folder off it.
sys.path[:] = [str(ROOT), *(entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "bench")]

from bench.precision import CALIBRATION, EVALUATION, OUTPUTS, cosines, load_feeds  # noqa: E402
from bench.runner import Timing, machine, markdown_table  # noqa: E402

BATCH, WARMUP = 8, 5
TOML = ROOT / "samples" / "minilm" / "tensorsmith.toml"


def cpu_variant(artifact: Path) -> tuple[str, Path]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    name = next(target["variant"] for target in manifest["targets"] if target["name"] == "cpu")
    return name, artifact / next(v["path"] for v in manifest["variants"] if v["name"] == name)


def open_model(kind: str, path: Path, artifact: Path, threads: int) -> Any:
    """`run(feeds) -> {name: array}` of one side: `load` (the artifact through tensorsmith.runtime.load on ONNX
    Runtime), `auto` (through load() on the backend the compile recorded),
    `onnxruntime` or `openvino` (the file at `path` with the artifact's specs)."""
    from tensorsmith.runtime import load
    from tensorsmith.runtime.manifest import read_manifest

    if kind == "load":
        return load(artifact, backend="onnxruntime")
    if kind == "auto":  # what a service gets: the backend the compile chose for the pair
        return load(artifact)
    manifest = read_manifest(artifact)
    inputs, outputs = [r.spec() for r in manifest.inputs], [r.spec() for r in manifest.outputs]
    if kind == "onnxruntime":
        from tensorsmith.runtime.onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(path, inputs, outputs, ["CPUExecutionProvider"], manifest.dims)
    from tensorsmith.runtime.openvino_backend import OpenVinoBackend

    return OpenVinoBackend(path, inputs, outputs, manifest.dims, threads=threads)


def measure(kind: str, path: Path, artifact: Path, threads: int, runs: int, result: Path) -> None:
    """In the model's own process: load, time, then the held-out outputs (to `result`.npz) and figures (json)."""
    from tensorsmith.runtime import TensorsmithError

    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:threads]))
    evaluation = load_feeds(EVALUATION)
    batch = {name: array[:BATCH] for name, array in evaluation.items()}
    started = time.perf_counter()
    try:
        model = open_model(kind, path, artifact, threads)
    except TensorsmithError as err:  # the row says why the model does not load
        result.with_suffix(".json").write_text(json.dumps({"error": err.message}))
        return
    loaded = time.perf_counter() - started
    for _ in range(WARMUP):
        model.run(batch)
    timing = Timing(kind)
    for _ in range(runs):
        started = time.perf_counter()
        model.run(batch)
        timing.seconds.append(time.perf_counter() - started)
    parts = [model.run({n: a[i : i + BATCH] for n, a in evaluation.items()}) for i in range(0, 64, BATCH)]
    np.savez(result.with_suffix(".npz"), **{name: np.concatenate([p[name] for p in parts]) for name in OUTPUTS})
    figures = {"load_s": loaded, "summary": timing.summary(), "median": timing.median, "backend": model.name
               if hasattr(model, "name") else model.backend}  # fmt: skip
    result.with_suffix(".json").write_text(json.dumps(figures))


def quantize_with_nncf(fp32: Path, output: Path) -> None:
    """NNCF's post-training int8 of the fp32 graph as OpenVINO reads it, saved as IR (weights kept in fp32)."""
    import nncf
    import openvino

    model = openvino.Core().read_model(str(fp32))
    calibration = load_feeds(CALIBRATION)
    count = len(next(iter(calibration.values())))
    items = [{name: array[i : i + 1] for name, array in calibration.items()} for i in range(count)]  # one each
    dataset, transformer = nncf.Dataset(items), nncf.ModelType.TRANSFORMER
    quantized = nncf.quantize(model, dataset, model_type=transformer, subset_size=count)
    openvino.save_model(quantized, str(output), compress_to_fp16=False)


def process(command: list[str], log: Path) -> tuple[float, float, int]:
    """(wall s, peak RSS MB, exit code) of `command` in a fresh process; its stdout and stderr go to `log`."""
    started = time.perf_counter()
    with log.open("w") as stream:
        child = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - started, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def compiled(given: Path | None, scratch: Path, name: str, flags: list[str]) -> Path:
    if given is not None:
        return given
    out = scratch / name
    command = [str(Path(sys.executable).with_name("tensorsmith")), "compile", str(TOML), "-o", str(out), *flags]
    _, _, code = process(command, scratch / f"{name}.log")
    if code:
        raise SystemExit(f"{' '.join(command)} failed (exit {code}); see {scratch / f'{name}.log'}")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":  # one model, in its own process
        kind, path, artifact, threads, runs, result = sys.argv[2:]
        measure(kind, Path(path), Path(artifact), int(threads), int(runs), Path(result))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--nncf":
        quantize_with_nncf(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--int8", type=Path, default=None)
    parser.add_argument("--auto", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="keep the scratch folder's logs and models here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tensorsmith-openvino-") as scratch_name:
        scratch = args.keep or Path(scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        calibration = ["--calibration", str(CALIBRATION), "--target", "cpu"]
        int8 = compiled(args.int8, scratch, "int8", ["--precision", "int8", *calibration])
        auto = compiled(args.auto, scratch, "auto", ["--precision", "auto", "--budget", "cosine>=0.995",
                                                     "--eval-data", str(EVALUATION), *calibration])  # fmt: skip
        fp32 = int8 / "model.onnx"
        nncf_ir = scratch / "nncf-int8.xml"
        nncf_made = process([sys.executable, __file__, "--nncf", str(fp32), str(nncf_ir)], scratch / "nncf.log")
        (int8_name, int8_path), (auto_name, auto_path) = cpu_variant(int8), cpu_variant(auto)
        rows_in: list[tuple[str, str, Path, Path]] = [
            ("ONNX Runtime fp32", "onnxruntime", fp32, int8),
            ("OpenVINO fp32", "openvino", fp32, int8),
            ("OpenVINO + NNCF int8 (IR)", "openvino", nncf_ir, int8),
            (f"ONNX Runtime, our {int8_name} (`--precision int8`)", "load", int8_path, int8),
            (f"OpenVINO, our {int8_name} (`--precision int8`)", "openvino", int8_path, int8),
            (f"ONNX Runtime, our {auto_name} (`--precision auto`)", "load", auto_path, auto),
            (f"OpenVINO, our {auto_name} (`--precision auto`)", "openvino", auto_path, auto),
            (f"our cpu target through `load()`: {auto_name} on the backend the compile chose", "auto", auto_path, auto),
        ]
        results = []
        for index, (label, kind, path, artifact) in enumerate(rows_in):
            result = scratch / f"model-{index}"
            command = [sys.executable, __file__, "--measure", kind, str(path), str(artifact), str(args.threads),
                       str(args.runs), str(result)]  # fmt: skip
            wall, rss, code = process(command, scratch / f"model-{index}.log")
            figures = json.loads(result.with_suffix(".json").read_text()) if code == 0 else {"error": f"exit {code}"}
            outputs = load_feeds(result.with_suffix(".npz")) if "error" not in figures else None
            results.append((label, path, figures, outputs, rss))
        print(table(results, args), "\n")
        wall, rss, code = nncf_made
        print(f"NNCF's quantization: {wall:.0f} s, peak RSS {rss:.0f} MB (exit {code}), in its own process.")


def table(results: list[tuple[str, Path, dict[str, Any], dict[str, np.ndarray] | None, float]], args: Any) -> str:
    reference = results[0][3]
    assert reference is not None, results[0][2]
    baseline = results[0][2]["median"]
    rows = []
    for label, path, figures, outputs, rss in results:
        size = sum(p.stat().st_size for p in path.parent.glob(path.stem + ".*")) / 1e6
        if outputs is None:
            rows.append([label, "—", "—", "—", "—", "—", f"{rss:.0f}", "—", f"{size:.0f}", figures["error"][:160]])
            continue
        sentence = cosines(reference["sentence_embedding"], outputs["sentence_embedding"])
        tokens = cosines(reference["token_embeddings"], outputs["token_embeddings"])
        rows.append([label, figures["summary"], f"{figures['median'] / baseline:.2f}", f"{sentence.mean():.4f}",
                     f"{sentence.min():.4f}", f"{tokens.mean():.4f}", f"{rss:.0f}", f"{figures['load_s']:.1f}",
                     f"{size:.0f}", figures["backend"]])  # fmt: skip
    header = ["model", "ms min / median / max", "latency vs ORT fp32", "cosine mean", "cosine min", "token cosine",
              "peak RSS MB", "load s", "MB on disk", "backend"]  # fmt: skip
    title = (f"{machine()}; MiniLM, batch {BATCH} × 64 tokens, {args.threads} threads (process pinned to "
             f"{args.threads} cores), median of {args.runs} runs after {WARMUP} warm-up, one process per model; "
             f"cosines against ONNX Runtime fp32 on the 64 held-out sentences; load average "
             f"{os.getloadavg()[0]:.1f} when done")  # fmt: skip
    return f"{title}\n\n{markdown_table(header, rows)}"


if __name__ == "__main__":
    main()
