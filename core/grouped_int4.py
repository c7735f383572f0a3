"""INT4 weights as pre-quantized checkpoints publish them, unpacked into one form: codes, group scales and zero
points of a weight [K, N] (K the input features, as the graph's MatMul reads it).

Each layout is read by its published definition (REFERENCE.md §12):

- compressed-tensors `pack-quantized` (llm-compressor; what vLLM serves): `weight_packed` int32 [N, K/8], eight
  codes a word along K, the first in the lowest nibble, each stored as q + 8; `weight_scale` [N, K/G];
  `weight_zero_point` int32 [N/8, K/G] packed the same way along N (asymmetric schemes only).
- AutoAWQ's GEMM: `qweight` int32 [K, N/8], word c holding columns 8c + (0, 2, 4, 6, 1, 3, 5, 7) from the lowest
  nibble up, codes 0..15; `qzeros` int32 [K/G, N/8] packed the same way; `scales` fp16 [K/G, N].
- GPTQ: `qweight` int32 [K/8, N], word r holding rows 8r..8r+7 from the lowest nibble up; `qzeros` int32
  [K/G, N/8] along N in order, stored as zero - 1 in the original (`gptq`, v1) format; `scales` [K/G, N];
  `g_idx` [K] (each row's group: in order unless the checkpoint was quantized in act-order, whose rows are
  then sorted by group and read from the input in that order).

A weight is w = (q - z) · s per group of G rows; codes and zero points are kept signed (stored - 8), the form
TensorRT's INT4 DequantizeLinear takes (passes/int4.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble within a word, lowest nibble first
NIBBLES = np.arange(8, dtype=np.uint32) * 4


@dataclass(frozen=True)
class GroupedInt4:
    """One weight [K, N] in INT4: codes int8 in [-8, 7] [K, N], scales float32 [K/G, N], zero points int8 in
    [-8, 7] [K/G, N] (None: symmetric, every zero point 0)."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    group: int
    # GPTQ's act-order: row k of `codes` is the weight's input feature rows[k] (rows sorted by group, so that each
    # group is G consecutive rows); the MatMul then reads its input's features in this order. None: in order.
    rows: np.ndarray | None = None

    def dequantized(self, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """(q - z) · s [K, N] in float32 in the weight's own row order, rounded through `dtype` as the checkpoint's
        own dequantization computes it (in its scales' type: bf16 or fp16), so that the float graph is what
        transformers runs."""
        rows, columns = self.codes.shape
        grouped = self.codes.reshape(rows // self.group, self.group, columns).astype(np.float32)
        if self.zero_points is not None:
            grouped = grouped - self.zero_points[:, None, :].astype(np.float32)
        values = (grouped * self.scales[:, None, :]).reshape(rows, columns).astype(dtype).astype(np.float32)
        if self.rows is None:
            return values
        ordered = np.empty_like(values)
        ordered[self.rows] = values
        return ordered

    def scaled(self, factor: float) -> GroupedInt4:
        """The same codes, every scale times `factor` (a factor a graph pass folded into the weight)."""
        return replace(self, scales=self.scales * np.float32(factor))

    def zero_offsets(self) -> np.ndarray | None:
        """z · s [K/G, N]: what an asymmetric weight subtracts per group (passes/int4.py's correction)."""
        return None if self.zero_points is None else (self.zero_points.astype(np.float32) * self.scales)


def unpack_rows(words: np.ndarray) -> np.ndarray:
    """int32 [R, C] → the 4-bit codes 0..15 [R, 8C], the lowest nibble of each word first."""
    nibbles = (words.view(np.uint32)[:, :, None] >> NIBBLES) & 0xF
    return nibbles.reshape(words.shape[0], -1).astype(np.int8)


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """AutoAWQ's interleaved columns: int32 [R, C] → codes 0..15 [R, 8C] in column order."""
    nibbles = unpack_rows(words).reshape(words.shape[0], -1, 8)
    columns = np.empty_like(nibbles)
    columns[:, :, list(AWQ_ORDER)] = nibbles
    return columns.reshape(words.shape[0], -1)


def compressed_tensors_int4(packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None) -> GroupedInt4:
    """compressed-tensors' pack-quantized weight of a Linear [N, K]: its codes as [K, N]."""
    codes = unpack_rows(packed) - 8  # [N, K]
    scales = np.asarray(scale, np.float32)  # [N, K/G]
    zeros = None if zero_point is None else _asymmetric(unpack_rows(zero_point.T)[:, : scales.shape[0]] - 8)
    return GroupedInt4(
        np.ascontiguousarray(codes.T), np.ascontiguousarray(scales.T), zeros, codes.shape[1] // scales.shape[1]
    )


def awq_int4(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> GroupedInt4:
    """AutoAWQ's GEMM layout (zero points always stored)."""
    codes = unpack_awq(qweight) - 8
    scales = np.asarray(scales, np.float32)
    return GroupedInt4(codes, scales, _asymmetric(unpack_awq(qzeros) - 8), codes.shape[0] // scales.shape[0])


def gptq_int4(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, stored_minus_one: bool, g_idx: np.ndarray | None = None
) -> GroupedInt4:
    """GPTQ's layout. `stored_minus_one`: the original format's zero points, stored as zero - 1. `g_idx`: each
    row's group; out of row order (act-order, `desc_act`), the rows are sorted by group (a stable sort: G rows
    each, checked by the reader) and the weight says in which order its MatMul reads the input (`rows`)."""
    codes = unpack_rows(np.ascontiguousarray(qweight.T)).T - 8  # words run along K
    zeros = unpack_rows(qzeros) + (1 if stored_minus_one else 0) - 8  # 8: a stored 15, refused by the reader
    scales = np.asarray(scales, np.float32)
    group = codes.shape[0] // scales.shape[0]
    order = None if g_idx is None or in_row_order(g_idx, group) else np.argsort(g_idx, kind="stable")
    codes = codes if order is None else codes[order]
    return GroupedInt4(np.ascontiguousarray(codes), scales, _asymmetric(zeros), group, order)


def in_row_order(g_idx: np.ndarray, group: int) -> bool:
    """Whether GPTQ's `g_idx` puts row k in group k // G (quantized without act-order)."""
    return bool(np.array_equal(np.asarray(g_idx), np.arange(len(g_idx)) // group))


def _asymmetric(zeros: np.ndarray) -> np.ndarray | None:
    """The zero points where any differs from the middle code, else None (the symmetric form, no correction)."""
    return np.ascontiguousarray(zeros, dtype=np.int8) if zeros.any() else None
