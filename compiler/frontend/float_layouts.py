"""The float-coded layouts: float8 e4m3 with scales per tensor, channel or block (compressed-tensors' and Model
Optimizer's `weight_scale`, DeepSeek's `weight_scale_inv`; core/scaled_fp8.py reads them) and NVFP4 (Model
Optimizer's and compressed-tensors'; passes/nvfp4.py holds the form)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.frontend.layout_record import Layout
from tensorsmith.core.precisions import Element
from tensorsmith.core.scaled_fp8 import ScaledFp8, grid_block, scaled_fp8
from tensorsmith.passes.nvfp4 import NVFP4_BLOCK, Nvfp4Weight, stored_nvfp4


def _fp8(scales: str, block: tuple[int, int] | None = None) -> Callable[[CheckpointWeights, str], ScaledFp8]:
    def read(weights: CheckpointWeights, module: str) -> ScaledFp8:
        return scaled_fp8(weights.array(f"{module}.weight"), weights.array(f"{module}.{scales}"), block)

    return read


def _fp8_grid(block: tuple[int, int] | None) -> Callable[[tuple[int, int], tuple[int, ...]], bool]:
    return lambda weight, scales: grid_block(weight, scales, block) is not None


SCALED_FP8 = Layout(
    Element.FP8_E4M3,
    "weight_scale",
    "weight",
    "weight_scale",
    ("input_scale",),
    (1, 1),
    (0, 1),
    _fp8_grid(None),
    _fp8("weight_scale"),
)


def _nvfp4(second: str, inverse: bool) -> Callable[[CheckpointWeights, str], Nvfp4Weight]:
    """NVFP4 with its second-level scale `second`: Model Optimizer's `weight_scale_2` multiplies the block scales,
    compressed-tensors' `weight_global_scale` divides them."""

    def read(weights: CheckpointWeights, module: str) -> Nvfp4Weight:
        tensor = float(np.asarray(weights.array(f"{module}.{second}"), np.float32).reshape(-1)[0])
        packed = np.asarray(weights.array(f"{module}.{'weight_packed' if inverse else 'weight'}")).astype(np.uint8)
        scale = float(np.float32(1) / np.float32(tensor)) if inverse else tensor
        return stored_nvfp4(packed, weights.array(f"{module}.weight_scale"), scale)

    return read


def _nvfp4_grid(weight: tuple[int, int], scales: tuple[int, ...]) -> bool:
    return tuple(scales) == (weight[0], weight[1] // NVFP4_BLOCK) and weight[1] % NVFP4_BLOCK == 0


MODELOPT_NVFP4 = Layout(
    Element.FP4_E2M1,
    "weight_scale_2",
    "weight",
    "weight_scale",
    ("input_scale",),
    (1, 2),
    (0, 1),
    _nvfp4_grid,
    _nvfp4("weight_scale_2", inverse=False),
    ("F8_E4M3",),
)
COMPRESSED_NVFP4 = Layout(
    Element.FP4_E2M1,
    "weight_global_scale",
    "weight_packed",
    "weight_scale",
    ("input_global_scale",),
    (1, 2),
    (0, 1),
    _nvfp4_grid,
    _nvfp4("weight_global_scale", True),
    ("F8_E4M3",),
    "BF16",  # compressed-tensors decompresses NVFP4 into bfloat16 whatever the model's type
)


def block_fp8_layout(block: tuple[int, int] | None) -> Layout:
    """DeepSeek's layout, its blocks [bn, bk] as config.json declares them (a partial last block along N)."""
    return Layout(
        Element.FP8_E4M3,
        "weight_scale_inv",
        "weight",
        "weight_scale_inv",
        (),
        (1, 1),
        (0, 1),
        _fp8_grid(block),
        _fp8("weight_scale_inv", block),
    )
