"""Generation on the CPU, one checkpoint (samples/tinylm) and the same prompts, three ways, each in its own process:
tensorsmith (`compile`, then `load(...).generate`), ONNX Runtime GenAI (its model builder, `-e cpu -p fp32`, then
`og.Generator`) and transformers' `generate`. Per side: prefill ms for a 128-token prompt, decode tokens/s at
batch 1 and 8 (greedy, 64 new tokens, EOS off), the greedy tokens (compared across sides), and the process's wall
clock and peak RSS. Then which side's ONNX graph standalone TensorRT for RTX builds for sm_86.

    .venv/bin/python bench/generate.py              # prints the Markdown tables for docs/benchmarks.md

Needs onnxruntime-genai (`pip install onnxruntime-genai`; the dev extra has it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "samples" / "tinylm" / "checkpoint"
HELDOUT = ROOT / "samples" / "tinylm" / "heldout.txt"
PROMPT_TOKENS, NEW_TOKENS, BATCHES, RUNS = 128, 64, (1, 8), 3


def prompts() -> np.ndarray:
    """8 prompts of 128 tokens each, cut from the held-out text (no padding needed)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(HELDOUT.read_text()).ids
    return np.array([ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(max(BATCHES))], np.int64)


def _timed(generate: Any, batch: np.ndarray) -> tuple[float, float, list[list[int]]]:
    """(prefill ms, decode tokens/s, sequences) of one call; `generate(batch, stamp)` calls stamp() per token."""
    stamps: list[float] = []
    started = time.perf_counter()
    sequences = generate(batch, lambda: stamps.append(time.perf_counter()))
    decode = len(batch) * (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return (stamps[0] - started) * 1e3, decode, [list(map(int, row)) for row in sequences]


def side_tensorsmith(artifact: str, backend: str = "onnxruntime") -> Any:
    from tensorsmith.runtime import load

    model = load(artifact, backend=backend)  # type: ignore[arg-type]

    def generate(batch: np.ndarray, stamp: Any) -> np.ndarray:
        return model.generate(batch, max_new_tokens=NEW_TOKENS, eos_token_id=[], streamer=lambda _: stamp())

    return generate


def side_genai(directory: str) -> Any:
    import onnxruntime_genai as og

    model = og.Model(directory)

    def generate(batch: np.ndarray, stamp: Any) -> np.ndarray:
        params = og.GeneratorParams(model)
        length = batch.shape[1] + NEW_TOKENS
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(batch))
        generator = og.Generator(model, params)
        generator.append_tokens(batch.astype(np.int32))
        while not generator.is_done():
            generator.generate_next_token()
            stamp()
        return np.array([generator.get_sequence(i) for i in range(len(batch))])

    return generate


class TokenStamps:
    """A streamer for transformers' generate that calls `stamp` at each new token (its first put is the
    prompt)."""

    def __init__(self, stamp: Any) -> None:
        self.stamp, self.calls = stamp, 0

    def put(self, _: object) -> None:
        self.calls += 1
        if self.calls > 1:
            self.stamp()

    def end(self) -> None:
        pass


def side_transformers(directory: str) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = LlamaForCausalLM.from_pretrained(directory).eval()

    def generate(batch: np.ndarray, stamp: Any) -> np.ndarray:
        with torch.inference_mode():
            return model.generate(torch.from_numpy(batch), attention_mask=torch.ones_like(torch.from_numpy(batch)),
                                  do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  eos_token_id=None, pad_token_id=0, streamer=TokenStamps(stamp)).numpy()  # fmt: skip

    return generate


def side_tensorsmith_openvino(artifact: str) -> Any:
    """The same artifact's cpu variant on OpenVINO (`tensorsmith[openvino]`)."""
    return side_tensorsmith(artifact, backend="openvino")


SIDES = {"tensorsmith": side_tensorsmith, "tensorsmith on OpenVINO": side_tensorsmith_openvino,
         "onnxruntime-genai": side_genai, "transformers": side_transformers}  # fmt: skip


def run_side(name: str, path: str) -> dict[str, Any]:
    """In the side's own process: warm up, then RUNS timed calls per batch size; medians."""
    generate = SIDES[name](path)
    batch_prompts = prompts()
    figures: dict[str, Any] = {}
    for batch in BATCHES:
        _timed(generate, batch_prompts[:batch])  # warm-up
        runs = [_timed(generate, batch_prompts[:batch]) for _ in range(RUNS)]
        figures[f"batch{batch}"] = {"prefill_ms": statistics.median(r[0] for r in runs),
                                    "decode_tokens_per_second": statistics.median(r[1] for r in runs),
                                    "sequences": runs[0][2]}  # fmt: skip
    return figures


def _process(command: list[str]) -> tuple[float, float, int]:
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    return time.perf_counter() - started, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    if len(sys.argv) == 4:  # a side, in its own process
        Path(sys.argv[3]).write_text(json.dumps(run_side(sys.argv[1], sys.argv[2])))
        return
    python, tensorsmith = sys.executable, str(Path(sys.executable).with_name("tensorsmith"))
    with tempfile.TemporaryDirectory(prefix="tensorsmith-generate-") as scratch:
        work = Path(scratch)
        prepare = {
            "tensorsmith": [tensorsmith, "compile", str(CHECKPOINT), "-o", str(work / "ours"),
                            "--target", "cpu", "--target", "sm_86"],
            "onnxruntime-genai": [python, "-m", "onnxruntime_genai.models.builder", "-i", str(CHECKPOINT),
                                  "-o", str(work / "genai"), "-p", "fp32", "-e", "cpu", "-c", str(work / "cache")],
        }  # fmt: skip
        paths = {"tensorsmith": str(work / "ours"), "tensorsmith on OpenVINO": str(work / "ours"),
                 "onnxruntime-genai": str(work / "genai"), "transformers": str(CHECKPOINT)}  # fmt: skip
        os.environ["HF_HUB_OFFLINE"] = "1"
        made: dict[str, tuple[float, float, int]] = {}
        for name, command in prepare.items():
            made[name] = _process(command)
        results, processes = {}, {}
        for name in SIDES:
            figures = work / f"{name.replace(' ', '-')}.json"
            processes[name] = _process([python, __file__, name, paths[name], str(figures)])
            results[name] = json.loads(figures.read_text())
        ours = json.loads((work / "ours" / "manifest.json").read_text())
        sm86 = next(t for t in ours["targets"] if t["name"] == "sm_86")
        engines = {"tensorsmith": f"sm_86 {sm86['status']} by the compile ({sm86['variant']} variant, profiles "
                                  f"{(sm86.get('engine') or {}).get('profile_names')})",
                   "onnxruntime-genai": _builds(work / "genai" / "model.onnx"),
                   "transformers": "no ONNX graph"}  # fmt: skip
    _print(results, processes, made, engines)


def _builds(onnx_path: Path) -> str:
    from tensorsmith.compiler.engines.builder import build_engine
    from tensorsmith.compiler.engines.profiles import Profile
    from tensorsmith.core.errors import BuildError

    try:
        import onnx

        model = onnx.load(str(onnx_path), load_external_data=False)
        shapes = {}
        for value in model.graph.input:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
            fixed = tuple(d or (1 if i == 0 else 16) for i, d in enumerate(dims))
            shapes[value.name] = (fixed, fixed, fixed)
        build_engine(onnx_path, "sm_86", Profile(shapes))  # type: ignore[arg-type]
        return "builds"
    except BuildError as err:
        return f"does not build: {err.message[:160]}"


def _print(results: dict[str, Any], processes: dict[str, Any], made: dict[str, Any], engines: dict[str, str]) -> None:
    reference = results["transformers"]
    print("| side | prefill ms (128 tokens, batch 1) | decode tokens/s batch 1 | decode tokens/s batch 8 | "
          "greedy tokens = transformers | process wall s, peak RSS | preparing (wall s, peak RSS) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, figures in results.items():
        same = all(figures[f"batch{b}"]["sequences"] == reference[f"batch{b}"]["sequences"] for b in BATCHES)
        wall, rss, code = processes[name]
        prepared = f"{made[name][0]:.1f} s, {made[name][1]:.0f} MB" if name in made else "—"
        print(f"| {name} | {figures['batch1']['prefill_ms']:.1f} | {figures['batch1']['decode_tokens_per_second']:.0f}"
              f" | {figures['batch8']['decode_tokens_per_second']:.0f} | {'yes' if same else 'NO'} | "
              f"{wall:.1f} s, {rss:.0f} MB (exit {code}) | {prepared} |")  # fmt: skip
    print()
    for name, verdict in engines.items():
        print(f"- {name}: {verdict}")


if __name__ == "__main__":
    main()
