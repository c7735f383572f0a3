"""Compiles at real scale: decoders of public models' shapes (bench/shapes.py: config.json values, seeded random
weights saved in bf16), each compiled as a user would, each side its own process, beside ONNX Runtime GenAI's
model builder on the same checkpoint directory.

Per shape and side: wall clock (imports included), peak RSS (the process's, from wait4), the artifact's and its
engines' bytes; then decode tokens/s on the cpu model of each (batch 1, a 16-token prompt unless
--prompt-tokens says, 32 new tokens, the median of 3 after a warm-up), tensorsmith's cpu variant against GenAI's
cpu model of the same precision.

    .venv/bin/python -m bench.scale smollm-135m [qwen2.5-0.5b llama-3.2-1b qwen2.5-3b] [--skip-decode]
        [--sides='tensorsmith fp16,GenAI']   # only the sides whose names start so
        [--prompt-tokens=128]                # the decode's prompt (16 by default)

Sides: `tensorsmith compile DIR --target cpu --target sm_86 --target sm_120` (fp16 GPU variants, the fp32 cpu
variant) and the same with `--precision int4 --calibration heldout.txt` (AWQ), each also with `--export-cache`
(the fp16 compile filling it, the int4 compile reading it: a CI matrix's second compile); `--target sm_86
--precision int4 --int4-algorithm rtn` (the 3B shape's row: no calibration pass); GenAI's `-p fp32 -e cpu`,
`-p int4 -e cpu` and `-p fp16 -e cuda` (the builder writes the CUDA model on a machine without a GPU; it builds
no engine); Model Optimizer's ONNX INT4 (`awq_lite`, block 128; `bash bench/modelopt-site.sh` installs it) of
the fp32 model.onnx that the `tensorsmith fp16` side wrote (Model Optimizer starts from ONNX, not a checkpoint),
calibrated on 16 windows of the same text. A side that fails or runs out of memory is reported with its exit
status, not left out.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.shapes import SHAPES, make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "samples" / "tinylm" / "heldout.txt"
GPU_TARGETS = ["sm_86", "sm_120"]
NEW_TOKENS, RUNS = 32, 3
PROMPT_TOKENS = 16  # the decode's prompt, unless --prompt-tokens=N says
MEMORY_LIMIT = 21 << 30  # of the machine's 24 GB
SHAPES_DIRECTORY = Path(os.environ.get("TENSORSMITH_SHAPES", "/tmp/tensorsmith-shapes"))


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its children (engine builds run in child processes)."""
    total = 0
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if entry.name == str(pid) or fields.get("PPid", "").strip() == str(pid):
            total += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return total


def _process(command: list[str], log: Path) -> dict[str, Any]:
    """Wall seconds, peak RSS (GB of 10^9 bytes, as the aims are: the largest process of the side, from wait4, which
    counts its engine builders; and its tree, summed and polled) and exit status of `command`, its
    output to `log`. Killed past MEMORY_LIMIT of tree RSS, so that a side that would not fit does not take the
    machine down: reported as killed, with its peak."""
    started = time.perf_counter()
    peak_tree, killed = 0, False
    with log.open("w") as stream:
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            peak_tree = max(peak_tree, _tree_rss(process.pid))
            if peak_tree > MEMORY_LIMIT and not killed:
                killed = True
                subprocess.run(["pkill", "-KILL", "-P", str(process.pid)], check=False)
                process.kill()
            time.sleep(0.5)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return {"wall_s": round(time.perf_counter() - started, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
            "peak_tree_rss_gb": round(peak_tree / 1e9, 2), "exit": process.returncode,
            **({"killed_over_gb": MEMORY_LIMIT / 1e9} if killed else {})}  # fmt: skip


def _bytes(directory: Path, pattern: str = "**/*") -> int:
    return sum(path.stat().st_size for path in directory.glob(pattern) if path.is_file())


def _sides(checkpoint: Path, work: Path) -> dict[str, list[str]]:
    python, tensorsmith = sys.executable, str(Path(sys.executable).with_name("tensorsmith"))
    targets = [part for target in ["cpu", *GPU_TARGETS] for part in ("--target", target)]
    ours = [tensorsmith, "compile", str(checkpoint), *targets, "--json"]
    cached = ["--export-cache", str(work / "export-cache")]
    builder = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-c", str(work / "cache")]
    return {
        "tensorsmith fp16": [*ours, "-o", str(work / "ts-fp16")],
        # a CI matrix's second compile: the fp16 compile fills the export cache, the int4 one reads it
        "tensorsmith fp16, filling the export cache": [*ours, "-o", str(work / "ts-fp16-cached"), *cached],
        "tensorsmith int4 (AWQ)": [*ours, "-o", str(work / "ts-int4"), "--precision", "int4",
                                   "--calibration", str(TEXT)],
        "tensorsmith int4 (AWQ) from the export cache": [*ours, "-o", str(work / "ts-int4-cached"), "--precision",
                                                         "int4", "--calibration", str(TEXT), *cached],
        # beside GenAI's `-p int4 -e cpu` too: issue 39's 4x aim for AWQ (a calibration pass and the search)
        "tensorsmith int4 AWQ (cpu)": [tensorsmith, "compile", str(checkpoint), "--target", "cpu", "--json",
                                       "-o", str(work / "ts-int4-awq-cpu-only"), "--precision", "int4",
                                       "--calibration", str(TEXT)],
        "tensorsmith int4 RTN (sm_86)": [tensorsmith, "compile", str(checkpoint), "--target", "sm_86", "--json",
                                         "-o", str(work / "ts-int4-rtn"), "--precision", "int4",
                                         "--int4-algorithm", "rtn"],
        # beside GenAI's `-p int4 -e cpu`: the same work (a CPU model, weights rounded to nearest), issue 39's 2x aim
        "tensorsmith int4 RTN (cpu)": [tensorsmith, "compile", str(checkpoint), "--target", "cpu", "--json",
                                       "-o", str(work / "ts-int4-rtn-cpu-only"), "--precision", "int4",
                                       "--int4-algorithm", "rtn"],
        # the large shapes' row (8B): what a CPU-and-GPU artifact takes without a calibration pass
        "tensorsmith int4 RTN (cpu, sm_86)": [tensorsmith, "compile", str(checkpoint), "--target", "cpu", "--target",
                                              "sm_86", "--json", "-o", str(work / "ts-int4-rtn-cpu"), "--precision",
                                              "int4", "--int4-algorithm", "rtn"],
        # Model Optimizer's ONNX PTQ starts from an ONNX graph: tensorsmith fp16's fp32 model.onnx (that side first)
        "Model Optimizer int4 awq_lite (from model.onnx)": [python, "-m", "bench.scale", "--modelopt",
                                                            str(checkpoint), str(work / "ts-fp16"),
                                                            "-o", str(work / "modelopt-int4")],
        "GenAI -p fp32 -e cpu": [*builder, "-o", str(work / "genai-fp32"), "-p", "fp32", "-e", "cpu"],
        "GenAI -p int4 -e cpu": [*builder, "-o", str(work / "genai-int4"), "-p", "int4", "-e", "cpu"],
        "GenAI -p fp16 -e cuda": [*builder, "-o", str(work / "genai-fp16"), "-p", "fp16", "-e", "cuda"],
    }  # fmt: skip


def _decode_side(kind: str, path: str, prompt_tokens: int) -> dict[str, float]:
    """In its own process: tokens/s of greedy decoding on the cpu model at `path`."""
    import numpy as np

    prompt = np.random.default_rng(0).integers(3, 2000, (1, prompt_tokens)).astype(np.int64)
    if kind == "tensorsmith":
        from tensorsmith.runtime import load

        model = load(path)  # on a machine without a GPU: the cpu variant, on the backend the compile chose

        def generate(stamp: Any) -> None:
            model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], streamer=lambda _: stamp())
    else:
        import onnxruntime_genai as og

        genai = og.Model(path)

        def generate(stamp: Any) -> None:
            params = og.GeneratorParams(genai)
            params.set_search_options(max_length=prompt_tokens + NEW_TOKENS, min_length=prompt_tokens + NEW_TOKENS)
            generator = og.Generator(genai, params)
            generator.append_tokens(prompt)
            while not generator.is_done():
                generator.generate_next_token()
                stamp()

    rates = []
    for run in range(RUNS + 1):
        stamps: list[float] = []
        generate(lambda stamps=stamps: stamps.append(time.perf_counter()))
        if run:  # the first is the warm-up
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"decode_tokens_per_second": round(statistics.median(rates), 1)}


def measure(shape: str, decode: bool, only: list[str] | None = None, prompt_tokens: int = PROMPT_TOKENS
            ) -> dict[str, Any]:  # fmt: skip
    checkpoint = make_checkpoint(shape, SHAPES_DIRECTORY / shape)
    results: dict[str, Any] = {"checkpoint_gb": round(_bytes(checkpoint, "*.safetensors") / 1e9, 3)}
    with tempfile.TemporaryDirectory(prefix=f"tensorsmith-scale-{shape}-") as scratch:
        work = Path(scratch)
        for side, command in _sides(checkpoint, work).items():
            if only and not any(side.startswith(prefix) for prefix in only):
                continue
            out = Path(command[command.index("-o") + 1])
            figures = _process(command, work / f"{out.name}.log")
            if figures["exit"] != 0:
                figures["tail"] = (work / f"{out.name}.log").read_text()[-400:]
            elif out.is_dir():
                figures["artifact_gb"] = round(_bytes(out) / 1e9, 3)
                figures["engines_gb"] = round(_bytes(out, "engines/*") / 1e9, 3)
                if side.startswith("tensorsmith"):
                    figures.update(_compile_figures(out))
                if decode and "cuda" not in side and not side.startswith("Model Optimizer"):
                    kind = "tensorsmith" if side.startswith("tensorsmith") else "genai"
                    log = work / f"{out.name}-decode.json"
                    run = _process([sys.executable, "-m", "bench.scale", "--decode", kind, str(out), str(log),
                                    str(prompt_tokens)],
                                   work / f"{out.name}-decode.log")  # fmt: skip
                    figures["decode"] = json.loads(log.read_text()) if run["exit"] == 0 else run
            if out.is_dir() and out.name != "ts-fp16":  # measured: its disk goes (Model Optimizer's side reads ts-fp16)
                shutil.rmtree(out)
            results[side] = figures
            print(f"{shape} {side}: {figures}", file=sys.stderr, flush=True)
    return results


def _compile_figures(out: Path) -> dict[str, Any]:
    manifest = json.loads((out / "manifest.json").read_text())
    # each stage's seconds and the compiling process's sampled peak resident GB in it: where time and memory go
    steps = {step["name"]: [step["seconds"], round((step.get("peak_rss_bytes") or 0) / 1e9, 2)]
             for step in manifest["steps"]}  # fmt: skip
    figures: dict[str, Any] = {"steps": steps, "targets": {t["name"]: t["status"] for t in manifest["targets"]}}
    figures["variants"] = {variant["name"]: {"gb": round(_bytes(out, variant["path"] + "*") / 1e9, 3),
                                             "quantized_flops": variant["accuracy"].get("quantized_flops_fraction")}
                           for variant in manifest["variants"]}  # fmt: skip
    return figures


def _modelopt_side(checkpoint: Path, fp32_artifact: Path, out: Path) -> None:
    """In its own process: Model Optimizer's ONNX INT4 (awq_lite, block 128) of the fp32 graph tensorsmith wrote,
    calibrated on 16 windows of the same text (bench/modelopt-site.sh installs it). The artifact's model.onnx is
    the static-cache generation graph: its feeds are a prefill into an empty cache of a window's length."""
    import numpy as np
    import onnx
    from tokenizers import Tokenizer

    from bench.int4 import MODELOPT_SITE

    sys.path.append(str(MODELOPT_SITE))  # after .venv's: its onnx and onnxruntime are the ones used
    from modelopt.onnx.quantization import quantize as modelopt_quantize

    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(TEXT.read_text(encoding="utf-8")).ids
    rows, length = 16, 128
    tokens = np.array(ids[: rows * length], np.int64).reshape(rows, length)
    graph = onnx.load(str(fp32_artifact / "model.onnx"), load_external_data=False).graph
    feeds: dict[str, np.ndarray] = {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
                                    "position_ids": np.broadcast_to(np.arange(length), tokens.shape).copy(),
                                    "write_indices": np.zeros(rows, np.int64)}  # fmt: skip
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            dims = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
            feeds[value.name] = np.zeros((rows, dims[1], length, dims[3]), np.float32)
    feeds = {value.name: feeds[value.name] for value in graph.input}
    out.mkdir(parents=True, exist_ok=True)
    modelopt_quantize(str(fp32_artifact / "model.onnx"), quantize_mode="int4", calibration_method="awq_lite",
                      calibration_data=feeds, calibration_eps=["cpu"], output_path=str(out / "model.onnx"),
                      block_size=128, log_level="WARNING")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--modelopt"]:
        _modelopt_side(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[5]))
        return
    if sys.argv[1:2] == ["--decode"]:
        kind, path, log, prompt_tokens = sys.argv[2:6]
        Path(log).write_text(json.dumps(_decode_side(kind, path, int(prompt_tokens))))
        return
    shapes = [name for name in sys.argv[1:] if not name.startswith("--")] or ["smollm-135m"]
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    only = [part for arg in sys.argv if arg.startswith("--sides=") for part in arg.removeprefix("--sides=").split(",")]
    prompt = next((int(arg.split("=")[1]) for arg in sys.argv if arg.startswith("--prompt-tokens=")), PROMPT_TOKENS)
    results = {shape: measure(shape, "--skip-decode" not in sys.argv, only, prompt) for shape in shapes}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ["HF_HUB_OFFLINE"] = "1"
    main()
