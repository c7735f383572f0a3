"""A weight's INT4 codes computed when the variant file is written, a block of rows at a time.

WeightOnlyInt4 computes each weight's block scales when it runs (they need one read of the weight: 1/32 of its
float32 bytes at block 128), but not its codes: held until the save, every weight's codes are the variant's size
in memory (4.5 GB at Llama-3.1-8B's shape; as numpy's int8, a byte a value, before packing, twice that). `Int4Codes`
keeps the mapped float weight and its scales, and `save_mapped` (core/mapped_save.py) asks it to write itself: it
reads WRITE_BLOCK bytes of rows from the weight's file, quantizes them with the scales already chosen, packs them as
ONNX packs INT4 and writes them, then reads the next. The codes are the ones `quantize_int4` makes of the whole
weight: the same division, rounding and clipping, block by block.
"""

from __future__ import annotations

from typing import BinaryIO, TypeAlias

import ml_dtypes
import numpy as np
import onnx

from tensorsmith.core.checkpoint_references import ReferencedValues
from tensorsmith.core.mapped_graph import WRITE_BLOCK, ConvertedValues, MappedValues

RowValues: TypeAlias = MappedValues | ReferencedValues  # what reads_rows accepts

INT4_MIN, INT4_MAX = -8, 7


def codes(weight: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """q = clip(round(w / s), -8, 7) as int8, for `weight` [R, N] (R a multiple of `block`) and its `scale`
    [R/B, N]."""
    rows, columns = weight.shape
    blocks = weight.reshape(rows // block, block, columns) / scale[:, None, :]  # the one full-size float copy
    np.round(blocks, out=blocks)
    return np.clip(blocks, INT4_MIN, INT4_MAX, out=blocks).astype(np.int8).reshape(rows, columns)


class Int4Codes(ConvertedValues):
    """The INT4 codes of a float weight [K, N] read a block of rows at a time (mapped_graph.reads_rows), times
    AWQ's `input_scale` per row where given, with its block `scale` [K/B, N], made when read or written."""

    def __init__(self, source: RowValues, scale: np.ndarray, block: int, input_scale: np.ndarray | None) -> None:
        # ConvertedValues' own __init__ takes a conversion function: these need the rows' position too
        self.source, self.scale, self.block, self.input_scale = source, scale, block, input_scale
        self.shape = tuple(int(dim) for dim in source.shape)
        self.dtype = np.dtype(ml_dtypes.int4)
        self.nbytes = (int(np.prod(self.shape)) + 1) // 2

    def _rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the float weight, read (not mapped: the pages go to the page cache, not here)."""
        rows = self.source.rows(start, stop).astype(np.float32, copy=False)
        return rows * self.input_scale[start:stop, None] if self.input_scale is not None else rows

    def _codes(self, start: int, stop: int) -> np.ndarray:
        scale = self.scale[start // self.block : stop // self.block]
        return codes(self._rows(start, stop), scale, self.block)

    def load(self) -> np.ndarray:
        return self._codes(0, self.shape[0]).astype(ml_dtypes.int4)

    def write(self, stream: BinaryIO, name: str) -> onnx.TensorProto:
        rows, columns = self.shape
        step = max(1, WRITE_BLOCK // max(1, 4 * columns * self.block)) * self.block  # whole blocks: even counts
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            stream.write(onnx.numpy_helper.from_array(self._codes(start, stop).astype(ml_dtypes.int4)).raw_data)
        return onnx.TensorProto(name=name, dims=list(self.shape), data_type=onnx.TensorProto.INT4)

    @property
    def tensor(self) -> onnx.TensorProto:
        return onnx.numpy_helper.from_array(self.load())
