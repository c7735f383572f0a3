"""FP8 weights as pre-quantized checkpoints publish them, read into one form: float8 e4m3 codes of a weight
[K, N] (K the input features, as the graph's MatMul reads it) and float32 scales over a grid of blocks.

Each layout by its published definition (REFERENCE.md §12):

- DeepSeek-V3/R1, Qwen3-FP8 and transformers' FineGrainedFP8 (`quant_method: fp8`): `weight` float8_e4m3fn
  [N, K] and `weight_scale_inv` float32 [N/bn, K/bk] (blocks of `weight_block_size` [bn, bk], 128 x 128);
  w = q · s per block (the name says "inverse": it is the scale the codes are multiplied by).
- compressed-tensors `float-quantized` FP8 (llm-compressor's FP8 and FP8_DYNAMIC schemes: what vLLM serves):
  `weight` float8_e4m3fn [N, K] and `weight_scale` [1] (per tensor), [N, 1] (per output channel) or
  [N/bn, K/bk] (block strategy); w = q · s.
- Model Optimizer's FP8 Hugging Face exports (`quant_method: modelopt`, `quant_algo` FP8, FP8_PER_CHANNEL_PER_TOKEN
  or FP8_PB_WO): `weight` float8_e4m3fn [N, K] and `weight_scale` [] / [1], [N], or [N/128, 1, K/128, 1]; w = q · s.

A grid whose blocks do not divide the weight is refused by the reader (transformers refuses it too).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


@dataclass(frozen=True)
class ScaledFp8:
    """One weight [K, N] in float8 e4m3: codes [K, N] (ml_dtypes' float8_e4m3fn), scales float32 [K/bk, N/bn],
    one per block of bk rows (input features) and bn columns (output features)."""

    codes: np.ndarray
    scales: np.ndarray

    @property
    def block(self) -> tuple[int, int]:
        """(rows, columns) of one scale's block."""
        return self.codes.shape[0] // self.scales.shape[0], self.codes.shape[1] // self.scales.shape[1]

    def dequantized(self, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """q · s [K, N] in float32, rounded through `dtype` as the checkpoint's own dequantization computes it."""
        rows, columns = self.block
        scales = np.repeat(np.repeat(self.scales, rows, axis=0), columns, axis=1)
        return (self.codes.astype(np.float32) * scales).astype(dtype).astype(np.float32)


def scale_grid(scales: tuple[int, ...]) -> tuple[int, int]:
    """A stored scale's grid over a weight [N, K]: [] and [1] one scale, [N] or [N, 1] one an output channel,
    [N/bn, K/bk] (and Model Optimizer's [N/bn, 1, K/bk, 1]) one a block."""
    return (scales[0], int(np.prod(scales[1:], dtype=np.int64))) if scales else (1, 1)


def grid_divides(weight: tuple[int, ...], scales: tuple[int, ...]) -> bool:
    """Whether a scale grid (from the header) splits a weight [N, K] evenly."""
    grid = scale_grid(scales)
    return len(weight) == 2 and all(g > 0 and size % g == 0 for size, g in zip(weight, grid, strict=True))


def scaled_fp8(weight: np.ndarray, scale: np.ndarray) -> ScaledFp8:
    """A Linear's stored float8 weight [N, K] (as float8, or widened exactly to float32 as the checkpoint's
    reader gives it) and its scale grid ([], [1], [N, 1] or [N/bn, K/bk]), as [K, N]."""
    codes = np.asarray(weight).astype(E4M3)  # exact: every value is a float8 code
    grid = np.asarray(scale, np.float32)
    grid = grid.reshape(scale_grid(grid.shape))
    return ScaledFp8(np.ascontiguousarray(codes.T), np.ascontiguousarray(grid.T))


E4M3_MAX = 448.0


def quantize_fp8(weight: np.ndarray, block: int) -> ScaledFp8:
    """Round-to-nearest float8 e4m3 of a weight [K, N]: a scale per `block` rows of K and output column,
    amax / 448 (the largest e4m3 value), so that every block's largest value is representable."""
    rows, columns = weight.shape
    blocks = np.asarray(weight, np.float32).reshape(rows // block, block, columns)
    scales = np.maximum(np.abs(blocks).max(axis=1), np.float32(1e-12)) / np.float32(E4M3_MAX)
    codes = np.clip(blocks / scales[:, None, :], -E4M3_MAX, E4M3_MAX).reshape(rows, columns).astype(E4M3)
    return ScaledFp8(codes, scales.astype(np.float32))
