"""A block-scaled FP8 checkpoint (DeepSeek-V3's and Qwen3-FP8's layout) compiled as it is published, beside
compiling the bf16 checkpoint it was made from; each side its own process (bench/scale.py measures them).

The FP8 checkpoint is made from a shape's seeded bf16 checkpoint (bench/shapes.py): every decoder-layer Linear in
float8 e4m3 with a float32 `weight_scale_inv` per 128 x 128 block (amax / 448), config.json's
`quantization_config` as transformers' FineGrainedFP8 writes it.

    .venv/bin/python -m bench.prequantized_fp8 [qwen2.5-0.5b]

Per side (targets cpu, sm_89 and sm_120): wall, peak RSS, artifact and engine bytes, and each variant's accuracy
against the fp32 graph (the checkpoint as transformers runs it, verified at the compile) on held-out text.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.prequantized import compiled_side, quantized_copy
from bench.scale import SHAPES_DIRECTORY, TEXT, _bytes
from bench.shapes import make_checkpoint

BLOCK = 128
TARGETS = ("cpu", "sm_89", "sm_120")


def make_fp8_checkpoint(source: Path, directory: Path) -> Path:
    """`source` (a bf16 checkpoint directory) in block-scaled FP8 at `directory`."""
    import torch

    def quantize(module: str, weight: Any) -> dict[str, Any]:
        weight = weight.float()
        rows, columns = weight.shape
        padded = torch.nn.functional.pad(weight, (0, -columns % BLOCK, 0, -rows % BLOCK))
        blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        codes = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :columns]
        return {"weight": codes.to(torch.float8_e4m3fn).contiguous(), "weight_scale_inv": scale.contiguous()}

    settings = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return quantized_copy(source, directory, quantize, settings)


def sides(fp8: Path, bf16: Path, work: Path) -> dict[str, list[str]]:
    tensorsmith = str(Path(sys.executable).with_name("tensorsmith"))
    targets = [argument for target in TARGETS for argument in ("--target", target)]
    common = [*targets, "--eval-data", str(TEXT), "--json"]
    return {
        "tensorsmith, the FP8 checkpoint's codes": [tensorsmith, "compile", str(fp8), *common, "-o", str(work / "fp8")],
        "tensorsmith, fp16 from the bf16 checkpoint": [tensorsmith, "compile", str(bf16), *common, "--precision",
                                                        "fp16", "-o", str(work / "bf16")],
    }  # fmt: skip


def measure(shape: str) -> dict[str, Any]:
    bf16 = make_checkpoint(shape, SHAPES_DIRECTORY / shape)
    fp8 = make_fp8_checkpoint(bf16, SHAPES_DIRECTORY / f"{shape}-fp8")
    results: dict[str, Any] = {"fp8_checkpoint_gb": round(_bytes(fp8, "*.safetensors") / 1e9, 3),
                               "bf16_checkpoint_gb": round(_bytes(bf16, "*.safetensors") / 1e9, 3)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tensorsmith-prequantized-") as scratch:
        work = Path(scratch)
        for side, command in sides(fp8, bf16, work).items():
            results[side] = compiled_side(command, work, f"{shape} {side}")
    return results


def main() -> None:
    shapes = sys.argv[1:] or ["qwen2.5-0.5b"]
    print(json.dumps({shape: measure(shape) for shape in shapes}, indent=2))


if __name__ == "__main__":
    main()
