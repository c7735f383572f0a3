"""gpt-oss's MXFP4 experts kept as published on Blackwell, beside the same checkpoint's experts dequantized to
bf16 for the same target; each side its own process (bench/scale.py measures them).

The MXFP4 checkpoint is made from a shape's seeded bf16 checkpoint (bench/shapes.py): each stacked expert weight
`P` [E, K, N] as `P_blocks` [E, N, K/32, 16] and `P_scales` [E, N, K/32] (OCP MX rounding: passes/weight_formats/
mxfp4.py), config.json's `quantization_config` as OpenAI publishes it.

    .venv/bin/python -m bench.mxfp4 [gpt-oss-20b-2-layers]

Per side: wall, peak RSS, artifact and engine bytes, the variant's accuracy against the fp32 graph (the checkpoint
as transformers runs it) on held-out text.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.prequantized import compiled_side
from bench.scale import SHAPES_DIRECTORY, TEXT, _bytes
from bench.shapes import make_checkpoint
from tensorsmith.core.elements import Element
from tensorsmith.core.precisions import storing
from tensorsmith.passes.nvfp4 import E2M1_VALUES
from tensorsmith.passes.weight_formats.table import weight_format

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
BLOCK = 32
E8M0_BIAS = 127


def mxfp4_layout(weight: np.ndarray) -> dict[str, np.ndarray]:
    """[E, K, N] float32 → blocks [E, N, K/32, 16] uint8 (two e2m1 codes a byte, the even one low) and scales
    [E, N, K/32] uint8 (e8m0), each expert quantized as the mxfp4 format does."""
    format = weight_format(storing(Element.FP4_E2M1, BLOCK))
    blocks, scales = [], []
    for expert in weight:
        quantized = format.quantize(expert, BLOCK)  # codes [K, N] e2m1 values, scales [K/32, N] powers of two
        magnitude = np.abs(quantized.codes)[..., None] == np.asarray(E2M1_VALUES, np.float32)
        nibbles = magnitude.argmax(axis=-1).astype(np.uint8) | np.signbit(quantized.codes).astype(np.uint8) << 3
        nibbles = nibbles.T.reshape(nibbles.shape[1], -1, BLOCK)  # [N, K/32, 32]
        blocks.append(nibbles[..., 0::2] | nibbles[..., 1::2] << 4)
        scales.append((np.log2(quantized.scales).astype(np.int32) + E8M0_BIAS).astype(np.uint8).T)
    return {"blocks": np.stack(blocks), "scales": np.stack(scales)}


def make_mxfp4_checkpoint(source: Path, directory: Path) -> Path:
    """`source` (a bf16 gpt-oss checkpoint) with its experts in MXFP4 at `directory`, a shard at a time, its index
    rewritten; kept where it was made already."""
    import torch
    from safetensors.torch import load_file, save_file

    if (directory / "config.json").is_file():
        return directory
    scratch = directory.with_name(directory.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    renamed: dict[str, str] = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors = load_file(path)
        for name in [name for name in tensors if name.endswith(EXPERTS)]:
            stored = mxfp4_layout(tensors.pop(name).float().numpy())
            for part, values in stored.items():
                tensors[f"{name}_{part}"] = torch.from_numpy(np.ascontiguousarray(values))
                renamed[f"{name}_{part}"] = path.name
        save_file(tensors, scratch / path.name, metadata={"format": "pt"})
        print(f"{directory.name}: {path.name}", file=sys.stderr, flush=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, scratch / path.name)
    config = json.loads((scratch / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (scratch / "config.json").write_text(json.dumps(config, indent=2))
    index = scratch / "model.safetensors.index.json"
    if index.is_file():
        stored_index = json.loads(index.read_text())
        weights = {name: file for name, file in stored_index["weight_map"].items() if not name.endswith(EXPERTS)}
        stored_index["weight_map"] = {**weights, **renamed}
        index.write_text(json.dumps(stored_index, indent=2, sort_keys=True) + "\n")
    scratch.rename(directory)
    return directory


def measure(shape: str) -> dict[str, Any]:
    bf16 = make_checkpoint(shape, SHAPES_DIRECTORY / shape)
    mxfp4 = make_mxfp4_checkpoint(bf16, SHAPES_DIRECTORY / f"{shape}-mxfp4")
    results: dict[str, Any] = {"mxfp4_checkpoint_gb": round(_bytes(mxfp4, "*.safetensors") / 1e9, 3),
                               "bf16_checkpoint_gb": round(_bytes(bf16, "*.safetensors") / 1e9, 3)}  # fmt: skip
    tensorsmith = str(Path(sys.executable).with_name("tensorsmith"))
    common = [tensorsmith, "compile", str(mxfp4), "--eval-data", str(TEXT), "--json"]
    with tempfile.TemporaryDirectory(prefix="tensorsmith-mxfp4-") as scratch:
        work = Path(scratch)
        sides = {
            "the checkpoint's mxfp4 codes (sm_120's default)": [*common, "--target", "sm_120", "-o", str(work / "mx")],
            "converted to INT4 (sm_86, --precision int4 rtn)": [*common, "--target", "sm_86", "--precision", "int4",
                                                                "--int4-algorithm", "rtn", "-o", str(work / "int4")],
            "its experts dequantized, bf16 (sm_120)": [*common, "--target", "sm_120", "--precision", "bf16", "-o",
                                                       str(work / "bf16")],
        }  # fmt: skip
        for side, command in sides.items():
            results[side] = compiled_side(command, work, f"{shape} {side}")
    return results


def main() -> None:
    shapes = sys.argv[1:] or ["gpt-oss-20b-2-layers"]
    print(json.dumps({shape: measure(shape) for shape in shapes}, indent=2))


if __name__ == "__main__":
    main()
