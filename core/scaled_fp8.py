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

A grid that does not fit its weight is refused by the reader: it must split the weight evenly, or, where
config.json declares the block (`weight_block_size`), be ceil(N/bn) x ceil(K/bk) with K whole blocks (DeepSeek's
kernels take a partial last block along N; transformers' CPU dequantization refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


@dataclass(frozen=True)
class ScaledFp8:
    """One weight [K, N] in float8 e4m3: codes [K, N] (ml_dtypes' float8_e4m3fn), scales float32
    [ceil(K/bk), ceil(N/bn)], one per block of bk rows (input features) and bn columns (output features); the
    last block along N may be partial (DeepSeek-V3's 576-row kv_a_proj_with_mqa in blocks of 128)."""

    codes: np.ndarray
    scales: np.ndarray
    block: tuple[int, int]  # (rows, columns) of one scale's block

    def scaled(self, factor: float) -> ScaledFp8:
        """The same codes, every scale times `factor` (a factor a graph pass folded into the weight)."""
        return replace(self, scales=self.scales * np.float32(factor))

    def column_scales(self) -> np.ndarray:
        """[ceil(K/bk), N]: each scale repeated over its block's columns."""
        return np.repeat(self.scales, self.block[1], axis=1)[:, : self.codes.shape[1]]

    def dequantized(self, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """q · s [K, N] in float32, rounded through `dtype` as the checkpoint's own dequantization computes it."""
        scales = np.repeat(self.column_scales(), self.block[0], axis=0)[: self.codes.shape[0]]
        return (self.codes.astype(np.float32) * scales).astype(dtype).astype(np.float32)


def scale_grid(scales: tuple[int, ...]) -> tuple[int, int]:
    """A stored scale's grid over a weight [N, K]: [] and [1] one scale, [N] or [N, 1] one an output channel,
    [N/bn, K/bk] (and Model Optimizer's [N/bn, 1, K/bk, 1]) one a block."""
    return (scales[0], int(np.prod(scales[1:], dtype=np.int64))) if scales else (1, 1)


def grid_block(
    weight: tuple[int, ...], scales: tuple[int, ...], block: tuple[int, int] | None
) -> tuple[int, int] | None:
    """The [bn, bk] block a scale grid (from the header) gives a weight [N, K], or None where it does not fit:
    without a declared `block` the grid must split the weight evenly; with one (config.json's
    `weight_block_size`), the grid is ceil(N/bn) x ceil(K/bk) and bk divides K (TensorRT takes whole blocks
    along K only)."""
    grid = scale_grid(scales)
    if len(weight) != 2 or min(grid) <= 0:
        return None
    if block is None:
        whole = all(size % g == 0 for size, g in zip(weight, grid, strict=True))
        return (weight[0] // grid[0], weight[1] // grid[1]) if whole else None
    fits = grid == (-(-weight[0] // block[0]), -(-weight[1] // block[1])) and weight[1] % block[1] == 0
    return (min(block[0], weight[0]), block[1]) if fits else None


def scaled_fp8(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None = None) -> ScaledFp8:
    """A Linear's stored float8 weight [N, K] (as float8, or widened exactly to float32 as the checkpoint's
    reader gives it) and its scale grid ([], [1], [N], [N, 1], [N/bn, K/bk] or [N/bn, 1, K/bk, 1]), as [K, N];
    `block`: the declared [bn, bk] (the reader checked the grid fits: grid_block)."""
    codes = np.asarray(weight).astype(E4M3)  # exact: every value is a float8 code
    grid = np.asarray(scale, np.float32)
    found = grid_block(codes.shape, grid.shape, block)
    assert found is not None, f"a scale grid {grid.shape} that does not fit {codes.shape}: checked by the reader"
    grid = grid.reshape(scale_grid(grid.shape))
    return ScaledFp8(np.ascontiguousarray(codes.T), np.ascontiguousarray(grid.T), (found[1], found[0]))


E4M3_MAX = 448.0


def quantize_fp8(weight: np.ndarray, block: int) -> ScaledFp8:
    """Round-to-nearest float8 e4m3 of a weight [K, N]: a scale per `block` rows of K and output column,
    amax / 448 (the largest e4m3 value), so that every block's largest value is representable."""
    rows, columns = weight.shape
    blocks = np.asarray(weight, np.float32).reshape(rows // block, block, columns)
    scales = np.maximum(np.abs(blocks).max(axis=1), np.float32(1e-12)) / np.float32(E4M3_MAX)
    codes = np.clip(blocks / scales[:, None, :], -E4M3_MAX, E4M3_MAX).reshape(rows, columns).astype(E4M3)
    return ScaledFp8(codes, scales.astype(np.float32), (block, 1))
