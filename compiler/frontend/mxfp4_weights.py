"""gpt-oss's MXFP4 checkpoints (`quant_method: mxfp4`): each stacked expert weight `P` [E, K, N] is stored as
`P_blocks` [E, N, K/32, 16] (two e2m1 codes a byte, the even element in the low nibble) and `P_scales`
[E, N, K/32] (e8m0: a power of two, 2^(s − 127), per 32 codes along K), as the OCP MX format and transformers'
`convert_moe_packed_tensors` read them. The export reads `P` dequantized, one tensor at a time; a Blackwell target's
`mxfp4` variant keeps the codes and scales as stored (`stacked_codes`), every other variant starts from the
dequantized weights, as an FP8 checkpoint's do on a target without FP8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.targets import get_target
from tensorsmith.core.elements import Element
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.precisions import storing
from tensorsmith.passes.weight_formats.base import Quantized

logger = logging.getLogger(__name__)

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


def mxfp4_precision(config: CompileConfig) -> CompileConfig:
    """gpt-oss's MXFP4 experts kept as published where a target runs them (Blackwell: the e2m1 record in blocks of
    32), unless the config gives a precision; the other targets get the checkpoint's float type."""
    stored = storing(Element.FP4_E2M1, CODES_PER_BLOCK)
    runs = [target for target in config.targets if get_target(target).runs_precision(stored)]
    if "precision" in config.model_fields_set or not runs:
        return config
    logger.info("%s: mxfp4 experts, their codes kept as published for %s", config.source, ", ".join(runs))
    return config.model_copy(update={"precision": stored.name})


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

    def stacked_codes(self) -> dict[str, Callable[[], Quantized]]:
        """Each MXFP4 weight's codes and scales as stored, made when asked: [E, K, N] as the module holds it, e2m1
        values and 2^(s − 127) per 32 rows of K (both float32: exact), for a variant that keeps them
        (passes/weight_formats/stacked.py)."""
        return {name: partial(self._stacked, name) for name in self._virtual}

    def _stacked(self, name: str) -> Quantized:
        blocks_name, scales_name = self._virtual[name]
        blocks, exponents = self.array(blocks_name), self.array(scales_name)
        if (exponents == E8M0_NAN).any():
            self._refuse_nonfinite(scales_name, int((exponents == E8M0_NAN).sum()) * CODES_PER_BLOCK)
        codes = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
        codes[..., 0::2], codes[..., 1::2] = E2M1_VALUES[blocks & 0x0F], E2M1_VALUES[blocks >> 4]
        codes = codes.reshape(*blocks.shape[:-2], -1)  # [E, N, K]
        scales = np.ldexp(np.float32(1.0), exponents.astype(np.int32) - E8M0_BIAS).astype(np.float32)  # [E, N, K/32]
        return Quantized(
            np.ascontiguousarray(np.swapaxes(codes, -1, -2)), np.ascontiguousarray(np.swapaxes(scales, -1, -2))
        )

    def lazy(self, name: str, graph_name: str, referable: bool = False) -> ir.TensorProtocol:
        return super().lazy(name, graph_name, referable and name not in self._virtual)
