"""DeepSeek-V2-Lite's layers on the cpu target: the latent cache against the decompressed one, and routed experts
against every expert, each side compiled and measured in its own process.

    python -m bench.mla [--layers=N] [--sides=latent,full,every]   (default 4 layers: the dense first and 3 MoE)

The checkpoint has DeepSeek-V2-Lite's config.json values (hidden 2048, 16 heads, kv_lora_rank 512, qk_rope 64,
qk_nope 128, v_head 128, 64 routed experts of 1,408, 6 active, 2 shared, a vocabulary of 102,400) with its first N
layers, seeded bf16 weights (bench/shapes.py). Sides:

- latent cache, routed experts: `tensorsmith compile DIR --target cpu` (the default);
- decompressed cache (`--mla-cache full`), routed experts;
- latent cache, every expert: the same compile with the experts' gathered form switched off, so that a decode
  step computes all 64 experts for its token (the graph a dense export of the mixture gives).

Figures: compile wall and peak RSS, the cache's values per token and layer (from the manifest), decode tokens/s at
batch 1 after a 128- and a 1,024-token prompt (32 new tokens, the median of 3 in a process), measured in 3 rounds
over the sides in turn and reported as the rounds' median; the weights' bytes on disk.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.scale import _process
from bench.shapes import SAMPLE, TOKENIZER_FILES, shape_config, write_checkpoint

SIDES = {  # --sides name: the side's label, --mla-cache, the experts computed
    "latent": ("latent cache, routed experts", "latent", "routed"),
    "full": ("full cache, routed experts", "full", "routed"),
    "every": ("latent cache, every expert", "latent", "every"),
}
PROMPTS = (128, 1024)
ROUNDS = 3
RATE = "decode_tokens_per_second"


def _checkpoint(layers: int, directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    import shutil

    config = shape_config("deepseek-v2-lite")
    config.num_hidden_layers = layers
    write_checkpoint(config, directory)
    for name in TOKENIZER_FILES:
        shutil.copy(SAMPLE / name, directory / name)
    return directory


def _compile_side(mla_cache: str, experts: str, checkpoint: str, out: str) -> None:
    """In its own process: the compile, with every expert computed at every step where `experts` says so."""
    from tensorsmith.compiler import CompileConfig, compile
    from tensorsmith.compiler.frontend import routed_experts

    if experts == "every":
        routed_experts.GATHERED_PAIRS = 0  # every (token, expert) count takes the every-expert branch
    config = CompileConfig.create({"source": checkpoint, "targets": ["cpu"], "mla_cache": mla_cache})
    compile(config, Path(out))


def main() -> None:
    if sys.argv[1:2] == ["--compile"]:
        _compile_side(*sys.argv[2:6])
        return
    layers = next((int(arg.split("=")[1]) for arg in sys.argv if arg.startswith("--layers=")), 4)
    chosen = next((arg.split("=")[1].split(",") for arg in sys.argv if arg.startswith("--sides=")), list(SIDES))
    checkpoint = _checkpoint(layers, Path(f"/tmp/tensorsmith-shapes/deepseek-v2-lite-{layers}l"))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tensorsmith-mla-") as scratch:
        compiled: dict[str, Path] = {}
        for side, mla_cache, experts in (SIDES[name] for name in chosen):
            out = Path(scratch) / side.replace(" ", "-").replace(",", "")
            figures = _process([sys.executable, "-m", "bench.mla", "--compile", mla_cache, experts, str(checkpoint),
                                str(out)], Path(scratch) / f"{out.name}.log")  # fmt: skip
            results[side] = figures
            if figures["exit"] != 0:
                figures["tail"] = (Path(scratch) / f"{out.name}.log").read_text()[-600:]
                continue
            compiled[side] = out
            generation = json.loads((out / "manifest.json").read_text())["generation"]
            value_dim = generation["value_head_dim"] or generation["head_dim"]
            figures["cache_values_per_token_and_layer"] = generation["kv_heads"] * (generation["head_dim"] + value_dim)
            figures["weights_gb"] = round(sum(f.stat().st_size for f in out.rglob("*.data")) / 1e9, 2)
            print(f"{side}: {figures}", file=sys.stderr, flush=True)
        # decode measured in rounds, the sides in turn, each run its own process: a slow minute of the machine
        # falls on every side alike, and the median of the rounds is reported
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(ROUNDS):
            for side, out in compiled.items():
                for prompt in PROMPTS:
                    log = Path(scratch) / f"{out.name}-{prompt}.json"
                    run = _process([sys.executable, "-m", "bench.scale", "--decode", "tensorsmith", str(out),
                                    str(log), str(prompt)], Path(scratch) / f"{out.name}-{prompt}.log")  # fmt: skip
                    if run["exit"] == 0:
                        rates.setdefault((side, prompt), []).append(json.loads(log.read_text())[RATE])
        for (side, prompt), measured in rates.items():
            results[side][f"decode_{prompt}"] = {RATE: statistics.median(measured), "rounds": measured}
        for side in compiled:
            print(f"{side}: {results[side]}", file=sys.stderr, flush=True)
    print(json.dumps({"layers": layers, **results}, indent=1))


if __name__ == "__main__":
    main()
