"""onnx-graphsurgeon graphs whose weights stay in their file until a pass needs them, and are written once.

A billion-parameter graph held as a protobuf is its weights again in memory, and onnx-graphsurgeon's import,
a pass's arrays and the export each add a copy (the 1B shape's fp16 variant peaked above 21 GB that way). Here:

- `load_mapped(path)` reads the graph's structure only (`load_external_data=False`); each weight in the
  `.data` file becomes a constant whose values are a copy-on-write memory map of its bytes, made when a pass
  first reads it (`MappedValues`, an onnx-graphsurgeon `LazyValues`): nothing is read that no pass touches,
  and a pass that replaces a weight (fp16's conversion) drops the map.
- `save_mapped(graph, path)` (core/mapped_save.py) writes the weights one tensor at a time into `<name>.data`
  and points each constant at its written bytes before onnx-graphsurgeon exports the structure, so the export
  copies no weight and the graph stays valid (mapped) after the save. Saved over the file it was read from, the
  weights no pass touched stay where they are (core/file_layout.py). Small graphs are written with their weights
  inside, as `core/ir.save_onnx` writes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeGuard

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from tensorsmith.core import ir
from tensorsmith.core.checkpoint_references import ReferencedValues, holds_references, take_references
from tensorsmith.core.files import write_array

INLINE_BELOW = ir.INLINE_BELOW
WRITE_BLOCK = 64 << 20  # bytes of a converted weight written at a time
PACKED = frozenset({onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1})


class MappedValues(LazyValues):
    """A weight stored as external data: `load()` maps its bytes (copy-on-write: a pass that edits the array in
    place changes its own pages, never the file)."""

    def __init__(self, tensor: onnx.TensorProto, file: Path) -> None:
        super().__init__(tensor)
        fields = {entry.key: entry.value for entry in tensor.external_data}
        self.file = file
        self.offset = int(fields.get("offset", 0))
        self.length = int(fields["length"]) if "length" in fields else file.stat().st_size - self.offset

    def stored(self) -> np.ndarray:
        """The bytes as stored (packed for 4-bit types), mapped."""
        return np.memmap(self.file, dtype=np.uint8, mode="c", offset=self.offset, shape=(self.length,))

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a weight not packed (not INT4 or FP4), read rather than mapped: the pages go to
        the page cache, not to this process."""
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.tensor.data_type))
        row_shape = tuple(int(dim) for dim in self.tensor.dims[1:])
        per_row = int(np.prod(row_shape, dtype=np.int64))
        read = np.fromfile(
            self.file, dtype, (stop - start) * per_row, offset=self.offset + start * per_row * dtype.itemsize
        )
        return read.reshape((stop - start, *row_shape))

    def inline(self) -> onnx.TensorProto:
        """The tensor with its bytes inside it (read now)."""
        tensor = onnx.TensorProto()
        tensor.CopyFrom(self.tensor)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = self.stored().tobytes()
        return tensor

    def load(self) -> np.ndarray:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.tensor.data_type))
        shape = tuple(int(dim) for dim in self.tensor.dims)
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype)
        if self.tensor.data_type in PACKED:  # two values a byte: onnx unpacks them
            return np.asarray(onnx.numpy_helper.to_array(self.inline()))
        return np.memmap(self.file, dtype=dtype, mode="c", offset=self.offset, shape=shape)


class ConvertedValues(LazyValues):
    """A weight a pass converts (fp16's conversion of fp32 weights), converted when it is read or written rather
    than when the pass runs: `save_mapped` writes one at a time, so the converted weights are never all in memory
    (at the 1B shape the fp16 rewrite held 2.5 GB of them until the save, and peaked 5.1 GB above its start)."""

    def __init__(self, source: LazyValues, convert: Callable[[np.ndarray], np.ndarray], dtype: object) -> None:
        # LazyValues' own __init__ reads a TensorProto: these values have none until converted
        self.source, self.convert = source, convert
        self.shape, self.dtype = source.shape, np.dtype(dtype)  # type: ignore[call-overload]
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        return self.convert(self.source.load())

    def write(self, stream: BinaryIO, name: str) -> onnx.TensorProto:
        """Convert and write the values a block of rows at a time, and return the tensor (no data) they are. A
        mapped source is read with reads, not mapped: its pages go to the page cache, not to this process."""
        rows, row_shape = (int(self.shape[0]), tuple(self.shape[1:])) if len(self.shape) else (1, ())
        step = max(1, WRITE_BLOCK // max(1, self.nbytes // rows))
        source = self.source
        mapped = source if reads_rows(source) else None
        whole = np.asarray(source.load()).reshape((rows, *row_shape)) if mapped is None else None
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            if mapped is not None:
                block = mapped.rows(start, stop)
            else:
                assert whole is not None
                block = whole[start:stop]
            write_array(self.convert(block), stream)
        tensor = onnx.TensorProto(name=name, dims=[int(dim) for dim in self.shape])
        tensor.data_type = onnx.helper.np_dtype_to_tensor_dtype(self.dtype)
        return tensor

    @property
    def tensor(self) -> onnx.TensorProto:
        """What onnx-graphsurgeon exports for lazy values: the converted values."""
        return onnx.numpy_helper.from_array(self.load())


def reads_rows(values: object) -> TypeGuard[MappedValues | ReferencedValues]:
    """Whether `values` are read a block of rows at a time (`rows(start, stop)`) without loading them whole: a
    weight mapped from its file (not packed), or one read from a checkpoint's (core/checkpoint_references.py)."""
    if isinstance(values, MappedValues):
        return values.tensor.data_type not in PACKED
    return isinstance(values, ReferencedValues)


def convert_values(constant: gs.Constant, convert: Callable[[np.ndarray], np.ndarray], dtype: object) -> None:
    """Give `constant` the values `convert` makes of its own, of `dtype`: later (ConvertedValues) where its values
    are still in their file, else now."""
    values = constant._values
    if isinstance(values, LazyValues):
        constant._values = ConvertedValues(values, convert, dtype)
    else:
        constant.values = convert(np.asarray(values))


def load_mapped(path: Path) -> tuple[gs.Graph, onnx.ModelProto]:
    """The graph at `path` with its external weights mapped, and the structure it was imported from (the nodes'
    metadata, which onnx-graphsurgeon drops, is read from it)."""
    structure = onnx.load(str(path), load_external_data=False)
    imported, references = structure, {}
    if holds_references(structure):  # weights read from the checkpoint's own files: taken out of a copy
        imported = onnx.ModelProto()
        imported.CopyFrom(structure)
        references = take_references(imported, path.parent)
    graph = gs.import_onnx(imported)
    for tensor in all_tensors(graph):
        if isinstance(tensor, gs.Constant) and _is_external(tensor._values):
            location = next(entry.value for entry in tensor._values.tensor.external_data if entry.key == "location")
            tensor._values = MappedValues(tensor._values.tensor, path.parent / location)
        elif isinstance(tensor, gs.Variable) and tensor.name in references:
            tensor.to_constant(ReferencedValues(references[tensor.name], tensor.name))
    return graph, structure


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[tuple[gs.Graph, onnx.ModelProto]]:
    """load_mapped's graph and structure for the block inside; every weight a pass read is let go at its end."""
    graph, structure = load_mapped(path)
    with weights_released(graph):
        yield graph, structure


@contextlib.contextmanager
def weights_released(graph: gs.Graph) -> Iterator[None]:
    """Let go, at the block's end, of the values read from every constant `graph` has now (those a pass replaces
    inside the block too). onnx-graphsurgeon's tensors refer to themselves (their synchronized input and output
    lists), so a graph or a replaced weight let go waits for Python's cycle collector, and with it every array a
    pass read: a mapped weight's pages stay resident while its map lives (after the INT4 rewrite at the 1B shape,
    6 GB through the measurement that followed). Weights still unread (LazyValues) are kept: they hold no pages."""
    constants = constants_of(graph)
    try:
        yield
    finally:
        for constant in constants:
            if not isinstance(constant._values, LazyValues):
                constant._values = np.empty(0, np.uint8)


def values_unkept(constant: gs.Constant) -> np.ndarray:
    """A constant's values without keeping them loaded: onnx-graphsurgeon keeps a lazily loaded (or mapped)
    constant's values from their first access on, so a scan of every weight would hold all of them at once."""
    values = constant._values  # LazyValues until first accessed
    return values.load() if isinstance(values, LazyValues) else np.asarray(values)


def _is_external(values: object) -> bool:
    return (
        isinstance(values, LazyValues)
        and not isinstance(values, MappedValues)
        and values.tensor.data_location == onnx.TensorProto.EXTERNAL
    )


def weight_bytes(graph: gs.Graph) -> int:
    """The constants' bytes, loaded or not (onnx-graphsurgeon's LazyValues and numpy arrays both know theirs)."""
    return sum(int(constant._values.nbytes) for constant in constants_of(graph))


def constants_of(graph: gs.Graph) -> list[gs.Constant]:
    """The graph's constants, those only its control flow's branches read included (an If's experts)."""
    return [tensor for tensor in all_tensors(graph) if isinstance(tensor, gs.Constant)]


def all_tensors(graph: gs.Graph) -> list[gs.Tensor]:
    """Every tensor of `graph` and of its nodes' subgraphs, once (a branch reads the outer graph's own)."""
    found: dict[int, gs.Tensor] = {}
    for each in [graph, *graph.subgraphs(recursive=True)]:
        for tensor in each.tensors().values():
            found.setdefault(id(tensor), tensor)
    return list(found.values())
