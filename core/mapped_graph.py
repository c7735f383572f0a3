"""onnx-graphsurgeon graphs whose weights stay in their file until a pass needs them, and are written once.

A billion-parameter graph held as a protobuf is its weights again in memory, and onnx-graphsurgeon's import,
a pass's arrays and the export each add a copy (the 1B shape's fp16 variant peaked above 21 GB that way). Here:

- `load_mapped(path)` reads the graph's structure only (`load_external_data=False`); each weight in the
  `.data` file becomes a constant whose values are a copy-on-write memory map of its bytes, made when a pass
  first reads it (`MappedValues`, an onnx-graphsurgeon `LazyValues`): nothing is read that no pass touches,
  and a pass that replaces a weight (fp16's conversion) drops the map.
- `save_mapped(graph, path)` writes the weights one tensor at a time into `<name>.data` and points each
  constant at its written bytes before onnx-graphsurgeon exports the structure, so the export copies no weight
  and the graph stays valid (mapped) after the save. Saved over the file it was read from, the weights no pass
  touched stay where they are and only the others are appended. Small graphs are written with their weights
  inside, as `core/ir.save_onnx` writes them.

Weights may be rewritten in place (a variant file the generation graphs rewrite): appended to, or, where too
much of the file would be left unread, new files written beside the old under temporary names, every old weight
read before the rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from tensorsmith.core import ir
from tensorsmith.runtime.manifest import external_data_path

logger = logging.getLogger(__name__)
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
        mapped = source if isinstance(source, MappedValues) and source.tensor.data_type not in PACKED else None
        whole = np.asarray(source.load()).reshape((rows, *row_shape)) if mapped is None else None
        if mapped is not None:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(mapped.tensor.data_type))
            per_row = int(np.prod(row_shape, dtype=np.int64))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            if mapped is not None:
                block = np.fromfile(mapped.file, dtype, (stop - start) * per_row,
                                    offset=mapped.offset + start * per_row * dtype.itemsize)  # fmt: skip
                block = block.reshape((stop - start, *row_shape))
            else:
                assert whole is not None
                block = whole[start:stop]
            np.ascontiguousarray(self.convert(block)).reshape(-1).tofile(stream)
        tensor = onnx.TensorProto(name=name, dims=[int(dim) for dim in self.shape])
        tensor.data_type = onnx.helper.np_dtype_to_tensor_dtype(self.dtype)
        return tensor

    @property
    def tensor(self) -> onnx.TensorProto:
        """What onnx-graphsurgeon exports for lazy values: the converted values."""
        return onnx.numpy_helper.from_array(self.load())


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
    graph = gs.import_onnx(structure)
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and _is_external(tensor._values):
            location = next(entry.value for entry in tensor._values.tensor.external_data if entry.key == "location")
            tensor._values = MappedValues(tensor._values.tensor, path.parent / location)
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
    constants = _constants(graph)
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
    return (isinstance(values, LazyValues) and not isinstance(values, MappedValues)
            and values.tensor.data_location == onnx.TensorProto.EXTERNAL)  # fmt: skip


def weight_bytes(graph: gs.Graph) -> int:
    """The constants' bytes, loaded or not (onnx-graphsurgeon's LazyValues and numpy arrays both know theirs)."""
    return sum(int(constant._values.nbytes) for constant in _constants(graph))


def _constants(graph: gs.Graph) -> list[gs.Constant]:
    return [tensor for tensor in graph.tensors().values() if isinstance(tensor, gs.Constant)]


def save_mapped(graph: gs.Graph, path: Path, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """Save `graph` at `path` (weights above EXTERNAL_DATA_ABOVE in all to `<name>.data`, one tensor at a time) and
    return the structure written. With external data, `graph`'s constants read the new file afterwards."""
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    path.parent.mkdir(parents=True, exist_ok=True)
    sidecar = external_data_path(path)
    constants = _constants(graph)
    for constant in constants:
        constant.data_location = None  # onnx-graphsurgeon would stamp an array it writes inline as external
        if isinstance(constant._values, MappedValues) and constant._values.length < INLINE_BELOW:
            constant._values = LazyValues(constant._values.inline())
        elif isinstance(constant._values, ConvertedValues) and constant._values.nbytes < INLINE_BELOW:
            constant.values = constant._values.load()
        elif _packed_array(constant._values):  # onnx-graphsurgeon would write numpy's int4 a byte each
            constant._values = LazyValues(onnx.numpy_helper.from_array(constant._values, constant.name))
    if weight_bytes(graph) <= ir.EXTERNAL_DATA_ABOVE:
        for constant in constants:
            if isinstance(constant._values, MappedValues):
                constant._values = LazyValues(constant._values.inline())  # inside the protobuf
        model = gs.export_onnx(graph)
        _attach(model, metadata)
        _replace(path, model.SerializeToString(), None)
        sidecar.unlink(missing_ok=True)
        return model
    in_place = _in_place(constants, sidecar)
    scratch = sidecar.with_name(f".{sidecar.name}.partial")
    written: list[tuple[gs.Constant, onnx.TensorProto]] = []
    # weights still in the file stay where they are and the rest is appended: the structure written before reads
    # only what was there, so the file stays whole until the new structure replaces it
    with sidecar.open("ab") if in_place else scratch.open("wb") as stream:
        for constant in constants:
            offset = stream.tell()
            if id(constant) in in_place:
                values = constant._values
                written.append((constant, _external(values.tensor, sidecar.name, values.offset, values.length)))
                continue
            if isinstance(constant._values, MappedValues):  # its stored bytes, copied as they are
                stored, tensor = constant._values.stored(), constant._values.tensor
                stored.tofile(stream)
                written.append((constant, _external(tensor, sidecar.name, offset, stored.nbytes)))
                continue
            if isinstance(constant._values, ConvertedValues):  # converted as it is written
                tensor = constant._values.write(stream, constant.name)
                written.append((constant, _external(tensor, sidecar.name, offset, stream.tell() - offset)))
                continue
            tensor = OnnxExporter.export_tensor_proto(constant)  # packed where the type is (INT4, FP4)
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_BELOW:
                continue  # small, or typed fields: stays inside the protobuf
            stream.write(tensor.raw_data)
            written.append((constant, _external(tensor, sidecar.name, offset, len(tensor.raw_data))))
            constant.values = np.empty(0, np.uint8)  # the array goes now
    for constant, tensor in written:
        constant._values = MappedValues(tensor, sidecar)
    model = gs.export_onnx(graph)
    _attach(model, metadata)
    _replace(path, model.SerializeToString(), None if in_place else scratch)
    return model


def _in_place(constants: list[gs.Constant], sidecar: Path) -> set[int]:
    """The ids of the constants whose bytes are still unread in `sidecar` itself, to be kept there; none where that
    would leave over DEAD_AT_MOST of the file unread (it is then rewritten whole). Saving a graph over its file (the
    passes after canonicalize, the generation graphs) rewrote every weight: 1.3 GB for 0.1 GB changed at 135M."""
    kept = [constant for constant in constants if sidecar.is_file() and isinstance(constant._values, MappedValues)
            and ir.same_file(constant._values.file, sidecar)]  # fmt: skip
    ids = {id(constant) for constant in kept}
    live = sum(int(constant._values.length) for constant in kept)
    added = sum(int(constant._values.nbytes) for constant in constants if id(constant) not in ids)
    size = sidecar.stat().st_size if kept else 0
    appending = bool(kept) and size - live <= ir.DEAD_AT_MOST * (size + added)
    logger.debug("%s: %d weights kept in place, %.1f MB appended, %.1f MB no longer read%s", sidecar.name, len(kept),
                 added / 1e6, (size - live) / 1e6, "" if appending else ": rewritten whole")  # fmt: skip
    return ids if appending else set()


def _packed_array(values: object) -> bool:
    if not isinstance(values, np.ndarray):
        return False
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(values.dtype) in PACKED
    except (KeyError, ValueError, TypeError):
        return False


def _external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> onnx.TensorProto:
    """`tensor`'s name, type and dims, its bytes at `offset` of `location`."""
    external = onnx.TensorProto(name=tensor.name, dims=list(tensor.dims), data_type=tensor.data_type)
    external.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        external.external_data.add(key=key, value=value)
    return external


def _attach(model: onnx.ModelProto, metadata: dict[str, str] | None) -> None:
    """Node metadata (module paths) by node name: onnx-graphsurgeon's export writes none."""
    if not metadata:
        return
    from tensorsmith.core.module_paths import attach_module_paths

    attach_module_paths(model, metadata)


def _replace(path: Path, structure: bytes, weights: Path | None) -> None:
    """The structure and its weights into place together: neither is renamed until both are written."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(structure)
    if weights is not None:
        os.replace(weights, external_data_path(path))
    os.replace(partial, path)
