"""gpt-oss's MXFP4 checkpoints (`quant_method: mxfp4`): each stacked expert weight `P` [E, K, N] is stored as
`P_blocks` [E, N, K/32, 16] (two e2m1 codes a byte, the even element in the low nibble) and `P_scales`
[E, N, K/32] (e8m0: a power of two, 2^(s − 127), per 32 codes along K), as the OCP MX format and transformers'
`convert_moe_packed_tensors` read them. The export reads `P` dequantized, one tensor at a time; no target takes
the codes as stored (TensorRT for RTX and ONNX Runtime have no MXFP4 GEMM here), so every variant starts from the
dequantized weights, as an FP8 checkpoint's do on a target without FP8.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

BLOCKS, SCALES = "_blocks", "_scales"
CODES_PER_BLOCK = 32
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
E8M0_BIAS = 127
E8M0_NAN = 255
HINT = "gpt-oss's MXFP4 checkpoints store each expert weight as <name>_blocks (uint8) and <name>_scales (uint8)"


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] packed codes and [..., G] exponents → [..., G·32] float32: each code's e2m1 value times 2^(s − 127)
    (an exponent of 255, e8m0's NaN, gives NaN)."""
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    nan = scales == E8M0_NAN
    exponents = np.where(nan, E8M0_BIAS, scales).astype(np.int32) - E8M0_BIAS
    np.ldexp(values, exponents[..., None], out=values)
    values[nan] = np.nan
    return values.reshape(*blocks.shape[:-2], -1)


class Mxfp4Weights(CheckpointWeights):
    """An MXFP4 checkpoint's tensors as the export reads a float checkpoint's: each `P` whose `P_blocks` and
    `P_scales` are stored is there too, [E, K, N] as transformers' module holds it, dequantized when read (never a
    reference to stored bytes)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._virtual: dict[str, tuple[str, str]] = {}
        for name in [name for name in self.names() if name.endswith(BLOCKS)]:
            weight = name.removesuffix(BLOCKS)
            scales = weight + SCALES
            if scales not in self:
                raise ConfigError(f"{directory}: {scales} is missing beside {name}", hint=HINT)
            shape, grid = self.shape(name), self.shape(scales)
            if self.dtype_code(name) != "U8" or self.dtype_code(scales) != "U8":
                raise ConfigError(f"{directory}: {name} and {scales} must be stored as U8 (uint8)", hint=HINT)
            if len(shape) != 4 or shape[:-1] != grid or shape[-1] != CODES_PER_BLOCK // 2:
                raise ConfigError(
                    f"{directory}: {name} {list(shape)} and {scales} {list(grid)} are not stacked experts' blocks "
                    f"of {CODES_PER_BLOCK} codes with one exponent each ([experts, N, K/32, 16] and [experts, N, "
                    "K/32])",
                    hint=HINT,
                )
            *stack, columns, groups, _ = shape
            self._virtual[weight] = (name, scales)
            self._files[weight], self._codes[weight] = self._files[name], "BF16"  # as transformers dequantizes it
            self._shapes[weight] = (*stack, groups * CODES_PER_BLOCK, columns)
        if not self._virtual:
            raise ConfigError(f"{directory}: quant_method mxfp4, but no tensor is named *{BLOCKS}", hint=HINT)

    def stands_for(self) -> dict[str, tuple[str, ...]]:
        return dict(self._virtual)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._virtual:
            return super().tensor(name)
        import torch

        blocks, scales = (self.array(part) for part in self._virtual[name])
        values = dequantize_mxfp4(blocks, scales)  # [..., N, K]
        weight = np.ascontiguousarray(np.swapaxes(values, -1, -2))
        self.on_read()
        if not np.isfinite(weight.sum()):
            self._refuse_nonfinite(self._virtual[name][1], int((~np.isfinite(weight)).sum()))
        return torch.from_numpy(weight)

    def lazy(self, name: str, graph_name: str, referable: bool = False) -> ir.TensorProtocol:
        return super().lazy(name, graph_name, referable and name not in self._virtual)
