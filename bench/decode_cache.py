"""Decode speed on the CPU by KV-cache layout, at a real shape: the SmolLM-135M decoder (bench/shapes.py, bf16
seeded weights) compiled for the cpu target with the static cache (the default: request-long caches written in
place) and with `--kv-cache dynamic` (the cache grown by Concat each step: tensorsmith before issue 25), fp32 and
`--precision int4` (round-to-nearest), beside ONNX Runtime GenAI's `-p fp32|int4 -e cpu` models of the same
checkpoint.

Each side runs in its own process: greedy decoding, EOS off, at batch 1 and 8 with 128 and 1,024 tokens of
context (the prompt), DECODE_TOKENS new tokens; tokens/s counts the steps after the first SKIPPED (the prefill and
the first steps' warm-up left out), rows × steps / seconds.

    .venv/bin/python -m bench.decode_cache [--sides='tensorsmith static fp32,GenAI fp32']
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.scale import SHAPES_DIRECTORY, _process
from bench.shapes import make_checkpoint

SHAPE = "smollm-135m"
CONTEXTS, BATCHES, DECODE_TOKENS, SKIPPED = (128, 1024), (1, 8), 24, 4


def _compiles(checkpoint: Path, work: Path) -> dict[str, tuple[str, list[str]]]:
    """side → (kind, the command that writes its model directory)."""
    python, tensorsmith = sys.executable, str(Path(sys.executable).with_name("tensorsmith"))
    ours = [tensorsmith, "compile", str(checkpoint), "--target", "cpu", "--max-sequence-length", "1152"]
    int4 = ["--precision", "int4", "--int4-algorithm", "rtn"]
    builder = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-c", str(work / "cache")]
    return {
        "tensorsmith static fp32": ("tensorsmith", [*ours, "-o", str(work / "static-fp32")]),
        "tensorsmith dynamic fp32": ("tensorsmith", [*ours, "-o", str(work / "dynamic-fp32"), "--kv-cache", "dynamic"]),
        "GenAI fp32": ("genai", [*builder, "-o", str(work / "genai-fp32"), "-p", "fp32", "-e", "cpu"]),
        "tensorsmith static int4": ("tensorsmith", [*ours, *int4, "-o", str(work / "static-int4")]),
        "tensorsmith dynamic int4": (
            "tensorsmith",
            [*ours, *int4, "-o", str(work / "dynamic-int4"), "--kv-cache", "dynamic"],
        ),
        "GenAI int4": ("genai", [*builder, "-o", str(work / "genai-int4"), "-p", "int4", "-e", "cpu"]),
    }


def _rate(stamps: list[float], rows: int) -> float:
    steps = stamps[SKIPPED:]
    return rows * (len(steps) - 1) / (steps[-1] - steps[0])


def decode_side(kind: str, path: str) -> dict[str, float]:
    """In its own process: tokens/s at each (batch, context)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if kind == "tensorsmith":
        from tensorsmith.runtime import load

        model = load(path)

        def generate(prompt: Any, stamp: Any) -> None:
            model.generate(prompt, max_new_tokens=DECODE_TOKENS, eos_token_id=[], streamer=lambda _: stamp())
    else:
        import onnxruntime_genai as og

        genai = og.Model(path)

        def generate(prompt: Any, stamp: Any) -> None:
            params = og.GeneratorParams(genai)
            length = prompt.shape[1] + DECODE_TOKENS
            params.set_search_options(max_length=length, min_length=length, batch_size=len(prompt))
            generator = og.Generator(genai, params)
            generator.append_tokens(prompt)
            stamp()  # the first token comes from the prefill
            while not generator.is_done():
                generator.generate_next_token()
                stamp()

    rates = {}
    for context in CONTEXTS:
        for batch in BATCHES:
            prompt = rng.integers(3, 40000, (batch, context)).astype(np.int64)
            stamps: list[float] = []
            generate(prompt, lambda stamps=stamps: stamps.append(time.perf_counter()))
            rates[f"batch {batch}, {context} tokens"] = round(_rate(stamps, batch), 1)
    return rates


def main() -> None:
    if sys.argv[1:2] == ["--decode"]:
        kind, path, log = sys.argv[2:5]
        Path(log).write_text(json.dumps(decode_side(kind, path)))
        return
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--sides=")), None)
    checkpoint = make_checkpoint(SHAPE, SHAPES_DIRECTORY / SHAPE)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tensorsmith-decode-cache-") as scratch:
        work = Path(scratch)
        for side, (kind, command) in _compiles(checkpoint, work).items():
            if only and not any(side.startswith(prefix) for prefix in only):
                continue
            out = Path(command[command.index("-o") + 1])
            compiled = _process(command, work / f"{out.name}-compile.log")
            if compiled["exit"] != 0:
                results[side] = {"compile": compiled, "log": (work / f"{out.name}-compile.log").read_text()[-2000:]}
                continue
            log = work / f"{out.name}-decode.json"
            run = subprocess.run([sys.executable, "-m", "bench.decode_cache", "--decode", kind, str(out), str(log)],
                                 capture_output=True, text=True)  # fmt: skip
            results[side] = json.loads(log.read_text()) if run.returncode == 0 else {"error": run.stderr[-2000:]}
            print(side, results[side], flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
