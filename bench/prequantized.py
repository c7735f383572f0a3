"""A pre-quantized checkpoint compiled as it is published, beside recompiling it from bf16 and beside ONNX Runtime
GenAI's builder on the same AWQ directory; each side its own process (bench/scale.py measures them).

The AWQ checkpoint is made from a shape's seeded bf16 checkpoint (bench/shapes.py) in AutoAWQ's GEMM layout:
every decoder-layer Linear in asymmetric INT4 groups of 128 rows, fp16 scales, packed as AutoAWQ's packer
writes it (the codes by round-to-nearest of each group's range: the layout, not AWQ's search, is what is read).

    .venv/bin/python -m bench.prequantized [qwen2.5-0.5b]

Per side: wall, peak RSS, artifact bytes, decode tokens/s on the cpu model (batch 1, a 128-token prompt, 32 new
tokens, median of 3), and for tensorsmith the perplexity ratio of its cpu variant against the checkpoint as
transformers runs it (the dequantized fp32 graph, itself verified against transformers), on held-out text.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.scale import SHAPES_DIRECTORY, TEXT, _bytes, _process
from bench.shapes import make_checkpoint
from tensorsmith.core.grouped_int4 import AWQ_ORDER

GROUP = 128
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_TOKENS = 128


def _pack(codes: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM words: [R, C] codes 0..15 → int32 [R, C/8], nibble i holding column 8c + AWQ_ORDER[i]."""
    words = np.zeros((codes.shape[0], codes.shape[1] // 8), np.uint32)
    for nibble, column in enumerate(AWQ_ORDER):
        words |= codes[:, column::8].astype(np.uint32) << (4 * nibble)
    return np.ascontiguousarray(words).view(np.int32)


def awq_layout(weight: np.ndarray) -> dict[str, np.ndarray]:
    """A Linear's weight [N, K] as AutoAWQ stores it: qweight [K, N/8], qzeros [K/G, N/8], fp16 scales [K/G, N]."""
    columns = weight.T.astype(np.float32)
    groups = columns.reshape(columns.shape[0] // GROUP, GROUP, -1)
    low, high = np.minimum(groups.min(1), 0), np.maximum(groups.max(1), 0)
    scales = np.maximum((high - low) / 15, 1e-8).astype(np.float16)
    zeros = np.clip(np.round(-low / scales.astype(np.float32)), 0, 15).astype(np.int32)
    codes = np.clip(np.round(groups / scales.astype(np.float32)[:, None] + zeros[:, None]), 0, 15).astype(np.int32)
    return {
        "qweight": _pack(codes.reshape(columns.shape)),
        "qzeros": _pack(zeros),
        "scales": np.ascontiguousarray(scales),
    }


def quantized_copy(source: Path, directory: Path, quantize: Callable[[str, Any], dict[str, Any]],
                   settings: dict[str, Any]) -> Path:  # fmt: skip
    """`source` (a bf16 checkpoint directory) at `directory` with each decoder-layer Linear's `weight` replaced by the
    tensors `quantize(module, weight)` gives (by name under the module), one shard at a time, config.json's
    `quantization_config` set to `settings`; kept where it was made already."""
    from safetensors.torch import load_file, save_file

    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.safetensors")):
        tensors = load_file(path)
        for name in [name for name in tensors if name.endswith(".weight") and name.split(".")[-2] in LINEARS]:
            module = name.removesuffix(".weight")
            stored = quantize(module, tensors.pop(name))
            tensors |= {f"{module}.{key}": value for key, value in stored.items()}
        save_file(tensors, directory / path.name, metadata={"format": "pt"})
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, directory / path.name)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = settings
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def make_awq_checkpoint(source: Path, directory: Path) -> Path:
    """`source` (a bf16 checkpoint directory) in AutoAWQ's GEMM layout at `directory`."""
    import torch

    def quantize(module: str, weight: Any) -> dict[str, Any]:
        return {key: torch.from_numpy(value) for key, value in awq_layout(weight.float().numpy()).items()}

    settings = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
    return quantized_copy(source, directory, quantize, settings)


def compile_side(command: list[str], work: Path) -> tuple[dict[str, Any], Path]:
    """Run one side's compile in its own process (bench/scale.py measures it): its figures (wall, peak RSS, exit;
    the log's tail if it failed, the artifact's bytes if not) and its output directory."""
    out = Path(command[command.index("-o") + 1])
    figures = _process(command, work / f"{out.name}.log")
    if figures["exit"] != 0:
        figures["tail"] = (work / f"{out.name}.log").read_text()[-600:]
    else:
        figures["artifact_gb"] = round(_bytes(out) / 1e9, 3)
    return figures, out


def compiled_side(command: list[str], work: Path, label: str) -> dict[str, Any]:
    """One side compiled in its own process (compile_side), with its artifact's engine sizes, each target's variant,
    each variant's accuracy and the source's weights where it exited 0; its output removed after."""
    figures, out = compile_side(command, work)
    if figures["exit"] == 0:
        manifest = json.loads((out / "manifest.json").read_text())
        figures["engines_gb"] = {path.stem: round(path.stat().st_size / 1e9, 3)
                                 for path in sorted((out / "engines").glob("*.engine"))}  # fmt: skip
        figures["targets"] = {target["name"]: target["variant"] for target in manifest["targets"]}
        figures["accuracy"] = {variant["name"]: variant["accuracy"] for variant in manifest["variants"]}
        figures["source_weights"] = manifest["source"].get("weights")
    shutil.rmtree(out, ignore_errors=True)
    print(f"{label}: {figures}", file=sys.stderr, flush=True)
    return figures


def sides(awq: Path, bf16: Path, work: Path) -> dict[str, list[str]]:
    tensorsmith = str(Path(sys.executable).with_name("tensorsmith"))
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-c", str(work / "cache")]
    return {
        "tensorsmith, the AWQ checkpoint's codes (cpu)": [tensorsmith, "compile", str(awq), "--target", "cpu",
                                                          "--eval-data", str(TEXT), "--json", "-o", str(work / "ts")],
        "tensorsmith int4 RTN from bf16 (cpu)": [tensorsmith, "compile", str(bf16), "--target", "cpu", "--precision",
                                                 "int4", "--int4-algorithm", "rtn", "--eval-data", str(TEXT),
                                                 "--json", "-o", str(work / "ts-rtn")],
        "GenAI -p int4 -e cpu, the AWQ checkpoint": [*builder, "-i", str(awq), "-o", str(work / "genai"), "-p",
                                                     "int4", "-e", "cpu"],
    }  # fmt: skip


def measure(shape: str) -> dict[str, Any]:
    bf16 = make_checkpoint(shape, SHAPES_DIRECTORY / shape)
    awq = make_awq_checkpoint(bf16, SHAPES_DIRECTORY / f"{shape}-awq")
    results: dict[str, Any] = {"awq_checkpoint_gb": round(_bytes(awq, "*.safetensors") / 1e9, 3),
                               "bf16_checkpoint_gb": round(_bytes(bf16, "*.safetensors") / 1e9, 3)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tensorsmith-prequantized-") as scratch:
        work = Path(scratch)
        for side, command in sides(awq, bf16, work).items():
            figures, out = compile_side(command, work)
            if figures["exit"] == 0:
                kind = "tensorsmith" if side.startswith("tensorsmith") else "genai"
                if kind == "tensorsmith":
                    manifest = json.loads((out / "manifest.json").read_text())
                    figures["accuracy"] = {variant["name"]: variant["accuracy"] for variant in manifest["variants"]}
                    figures["source_weights"] = manifest["source"].get("weights")
                    plan = json.loads((out / "precision.json").read_text())  # MatMulNBits' accuracy level, and why
                    figures["cpu"] = {name: (recipe.get("cpu") or {}).get("reason") for name, recipe in
                                      plan["recipes"].items()}  # fmt: skip
                log = work / f"{out.name}-decode.json"
                run = _process([sys.executable, "-m", "bench.scale", "--decode", kind, str(out), str(log),
                                str(PROMPT_TOKENS)], work / f"{out.name}-decode.log")  # fmt: skip
                figures["decode"] = json.loads(log.read_text()) if run["exit"] == 0 else run
            shutil.rmtree(out, ignore_errors=True)
            results[side] = figures
            print(f"{shape} {side}: {figures}", file=sys.stderr, flush=True)
    return results


def main() -> None:
    shapes = sys.argv[1:] or ["qwen2.5-0.5b"]
    print(json.dumps({shape: measure(shape) for shape in shapes}, indent=2))


if __name__ == "__main__":
    main()
