"""Qwen3.5-0.8B's shape (Gated DeltaNet beside gated full attention) on the cpu target, each side in its own process:

    python -m bench.hybrid [--layers=N]        (default 24: the whole model)

Sides:

- tensorsmith: `tensorsmith compile DIR --target cpu` (fp32, static cache: three layers of four keep fixed-size
  states), then generation on ONNX Runtime;
- transformers: the checkpoint in float32 with transformers' own generate (its prompt through the chunked delta
  rule, each new token through the recurrent one) — the anchor, since ONNX Runtime GenAI's builder takes Qwen3.5
  only as the vision-language checkpoint (Qwen3_5ForConditionalGeneration).

Figures: compile wall and peak RSS; the cache per token (the attention layers' keys and values, which grow) and
per sequence (the states, which do not), from the manifest; for a 128- and a 1,024-token prompt at batch 1, the
prompt's seconds (to the first new token) and decode tokens/s over 32 new tokens, the median of 3 runs after a
warm-up.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.generate import TokenStamps
from bench.scale import _process
from bench.shapes import SAMPLE, TOKENIZER_FILES, shape_config, write_checkpoint

PROMPTS = (128, 1024)
NEW_TOKENS, RUNS = 32, 3


def _checkpoint(layers: int, directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    import shutil

    config = shape_config("qwen3.5-0.8b")
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers]
    write_checkpoint(config, directory)
    for name in TOKENIZER_FILES:
        shutil.copy(SAMPLE / name, directory / name)
    return directory


def _generation_side(kind: str, path: str, prompt_tokens: int) -> dict[str, float]:
    """In its own process: the prompt's seconds and decode tokens/s of greedy generation."""
    import numpy as np

    prompt = np.random.default_rng(0).integers(3, 2000, (1, prompt_tokens)).astype(np.int64)
    if kind == "tensorsmith":
        from tensorsmith.runtime import load

        model = load(path)

        def generate(stamp: Any) -> None:
            model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], streamer=lambda _: stamp())
    else:
        import torch
        import transformers

        torch.set_num_threads(2)
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        def generate(stamp: Any) -> None:
            with torch.no_grad():
                reference.generate(input_ids=torch.from_numpy(prompt), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, streamer=TokenStamps(stamp))  # fmt: skip

    prompts, rates = [], []
    for run in range(RUNS + 1):
        stamps: list[float] = []
        started = time.perf_counter()
        generate(lambda stamps=stamps: stamps.append(time.perf_counter()))
        if run:  # the first is the warm-up
            prompts.append(stamps[0] - started)
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"prompt_s": round(statistics.median(prompts), 2),
            "decode_tokens_per_second": round(statistics.median(rates), 1)}  # fmt: skip


def _cache_figures(out: Path) -> dict[str, int]:
    """Bytes a token adds to the cache (keys and values of the attention layers) and a sequence holds whatever
    its length (the linear-attention layers' states), fp32."""
    generation = json.loads((out / "manifest.json").read_text())["generation"]
    attention = generation["layers"] - len(generation["state_layers"])
    per_layer = 2 * generation["kv_heads"] * generation["head_dim"] * 4
    states = sum(math.prod(shape) for shape in generation["state_shapes"].values())
    return {"cache_bytes_per_token": attention * per_layer,
            "state_bytes_per_sequence": len(generation["state_layers"]) * states * 4,
            "cache_bytes_per_token_if_every_layer_attended": generation["layers"] * per_layer}  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--generate"]:
        kind, path, prompt, log = sys.argv[2:6]
        Path(log).write_text(json.dumps(_generation_side(kind, path, int(prompt))))
        return
    layers = next((int(arg.split("=")[1]) for arg in sys.argv if arg.startswith("--layers=")), 24)
    checkpoint = _checkpoint(layers, Path(f"/tmp/tensorsmith-shapes/qwen3.5-0.8b-{layers}l"))
    results: dict[str, Any] = {"layers": layers}
    tensorsmith = str(Path(sys.executable).with_name("tensorsmith"))
    with tempfile.TemporaryDirectory(prefix="tensorsmith-hybrid-") as scratch:
        out = Path(scratch) / "out"
        compiled = _process([tensorsmith, "compile", str(checkpoint), "--target", "cpu", "-o", str(out)],
                            Path(scratch) / "compile.log")  # fmt: skip
        if compiled["exit"] != 0:
            compiled["tail"] = (Path(scratch) / "compile.log").read_text()[-600:]
        results["tensorsmith"] = {"compile": compiled, **(_cache_figures(out) if compiled["exit"] == 0 else {})}
        results["transformers"] = {}
        for kind, path in (("tensorsmith", out), ("transformers", checkpoint)):
            if kind == "tensorsmith" and compiled["exit"] != 0:
                continue
            for prompt in PROMPTS:
                log = Path(scratch) / f"{kind}-{prompt}.json"
                run = _process([sys.executable, "-m", "bench.hybrid", "--generate", kind, str(path), str(prompt),
                                str(log)], Path(scratch) / f"{kind}-{prompt}.log")  # fmt: skip
                results[kind][f"prompt_{prompt}"] = json.loads(log.read_text()) if run["exit"] == 0 else run
                print(f"{kind} {prompt}: {results[kind][f'prompt_{prompt}']}", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
