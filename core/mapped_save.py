"""`save_mapped`: an onnx-graphsurgeon graph whose weights are mapped from their file (core/mapped_graph.py) saved
with its weights outside it, one tensor at a time, so that no weight is ever copied into a protobuf; saved over the
file it was read from, the weights no pass touched stay where they are (core/file_layout.py)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from tensorsmith.core import ir
from tensorsmith.core.branch_copies import share_branch_copies
from tensorsmith.core.checkpoint_references import Reference, ReferencedValues, holds_references, write_references
from tensorsmith.core.file_layout import nearly_all_read, plan_layout
from tensorsmith.core.files import write_array
from tensorsmith.core.mapped_graph import (
    INLINE_BELOW,
    PACKED,
    ConvertedValues,
    MappedValues,
    constants_of,
    mapped,
    weight_bytes,
)
from tensorsmith.core.module_paths import attach_module_paths, module_paths_recorded
from tensorsmith.runtime.manifest import checkpoint_links_path, external_data_path

logger = logging.getLogger(__name__)
CONVERTED = (ConvertedValues, ReferencedValues)  # values made as they are written (each has `write`)


def save_mapped(
    graph: gs.Graph, path: Path, metadata: dict[str, str] | None = None, references: bool = False
) -> onnx.ModelProto:
    """Save `graph` at `path` (weights above EXTERNAL_DATA_ABOVE in all to `<name>.data`, one tensor at a time) and
    return the structure written. With external data, `graph`'s constants read the new file afterwards. Weights read
    from a checkpoint (core/checkpoint_references.py) stay references with `references`, else are written as fp32."""
    kept = [
        (constant, constant._values)
        for constant in constants_of(graph)
        if references and isinstance(constant._values, ReferencedValues)
    ]
    for constant, _ in kept:
        constant._values = np.zeros(0, np.float32)  # a placeholder, replaced by its reference form in the structure
    try:
        return _save(graph, path, metadata, {constant.name: values.reference for constant, values in kept})
    finally:
        for constant, values in kept:
            constant._values = values


def _save(
    graph: gs.Graph, path: Path, metadata: dict[str, str] | None, references: dict[str, Reference]
) -> onnx.ModelProto:
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    path.parent.mkdir(parents=True, exist_ok=True)
    sidecar = external_data_path(path)
    constants = constants_of(graph)
    share_branch_copies(graph)  # an If's two copies of its experts: one values object, its bytes written once
    packed: dict[int, LazyValues] = {}  # copies sharing an array keep sharing its packed form
    for constant in constants:
        constant.data_location = None  # onnx-graphsurgeon would stamp an array it writes inline as external
        if isinstance(constant._values, MappedValues) and constant._values.length < INLINE_BELOW:
            constant._values = LazyValues(constant._values.inline())
        elif isinstance(constant._values, CONVERTED) and constant._values.nbytes < INLINE_BELOW:
            constant.values = constant._values.load()
        elif _packed_array(constant._values):  # onnx-graphsurgeon would write numpy's int4 a byte each
            array = constant._values
            if id(array) not in packed:
                packed[id(array)] = LazyValues(onnx.numpy_helper.from_array(array, constant.name))
            constant._values = packed[id(array)]
    if weight_bytes(graph) <= ir.EXTERNAL_DATA_ABOVE:
        for constant in constants:
            if isinstance(constant._values, MappedValues):
                constant._values = LazyValues(constant._values.inline())  # inside the protobuf
        model = gs.export_onnx(graph)
        write_references(model, references, path)
        _attach(model, metadata)
        _replace(path, model.SerializeToString(), None)
        sidecar.unlink(missing_ok=True)
        return model
    _share_weights(constants, sidecar)
    in_place = _in_place(constants, sidecar)
    kept, placed = in_place or (set(), {})
    scratch = sidecar.with_name(f".{sidecar.name}.partial")
    written: list[tuple[gs.Constant, onnx.TensorProto]] = []
    placed_at: dict[int, onnx.TensorProto] = {}  # a values object shared by copies (id) → where its bytes went

    def place(constant: gs.Constant, tensor: onnx.TensorProto) -> None:
        written.append((constant, tensor))
        placed_at[id(constant._values)] = tensor

    # weights still in the file stay where they are, new ones go into the bytes no weight reads any more where they
    # fit, the rest is appended; the structure is replaced last
    with sidecar.open("r+b") if in_place else scratch.open("wb") as stream:
        for constant in constants:
            if (copy_of := placed_at.get(id(constant._values))) is not None:  # a copy: the same bytes
                written.append((constant, _renamed(copy_of, constant.name)))
                continue
            if id(constant) in kept:
                values = constant._values
                place(constant, _external(values.tensor, sidecar.name, values.offset, values.length))
                continue
            if in_place:
                at = placed.get(id(constant))
                stream.seek(*((at, os.SEEK_SET) if at is not None else (0, os.SEEK_END)))
            offset = stream.tell()
            if isinstance(constant._values, MappedValues):  # its stored bytes, copied as they are
                stored, tensor = constant._values.stored(), constant._values.tensor
                write_array(stored, stream)
                place(constant, _external(tensor, sidecar.name, offset, stored.nbytes))
                continue
            if isinstance(constant._values, CONVERTED):  # converted as it is written
                tensor = constant._values.write(stream, constant.name)
                place(constant, _external(tensor, sidecar.name, offset, stream.tell() - offset))
                continue
            tensor = OnnxExporter.export_tensor_proto(constant)  # packed where the type is (INT4, FP4)
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_BELOW:
                continue  # small, or typed fields: stays inside the protobuf
            stream.write(tensor.raw_data)
            place(constant, _external(tensor, sidecar.name, offset, len(tensor.raw_data)))
            constant.values = np.empty(0, np.uint8)  # the array goes now
    for constant, tensor in written:
        constant._values = MappedValues(tensor, sidecar)
    model = gs.export_onnx(graph)
    write_references(model, references, path)
    _attach(model, metadata)
    _replace(path, model.SerializeToString(), None if in_place else scratch)
    return model


def _share_weights(constants: list[gs.Constant], sidecar: Path) -> None:
    """Saved as a new file, a graph whose every large weight is still, as stored, in one other file (the static
    cache's rewriting of a variant adds nodes, not weights) shares that file: a hard link at `sidecar`, which the
    in-place save then writes nothing into. Not where any large array is new (it would be written into the other
    graph's file too), nor where more of the file than DEAD_AT_MOST would go unread."""
    if sidecar.exists():
        return
    files: set[Path] = set()
    read = 0
    for values in {id(constant._values): constant._values for constant in constants}.values():  # copies once
        if isinstance(values, MappedValues):
            files.add(values.file)
            read += values.length
        elif values.nbytes >= INLINE_BELOW:
            return
    shared = nearly_all_read(files, read, ir.DEAD_AT_MOST)
    if shared is None:
        return
    try:
        os.link(shared, sidecar)
    except OSError as err:  # another file system, or one without hard links: written as a copy
        logger.debug("%s: not linked to %s (%s)", sidecar.name, shared, err)
        return
    logger.debug("%s: the weights of %s, linked", sidecar.name, shared)


def _in_place(constants: list[gs.Constant], sidecar: Path) -> tuple[set[int], dict[int, int]] | None:
    """How to save over `sidecar` (core/file_layout.py): the ids of the constants whose bytes are still unread
    there, kept; the offsets of new arrays written into bytes nothing reads any more (the rest is appended). None:
    rewrite it whole."""
    kept = [
        constant
        for constant in constants
        if sidecar.is_file()
        and isinstance(constant._values, MappedValues)
        and ir.same_file(constant._values.file, sidecar)
    ]
    if not kept:
        return None
    ids = {id(constant) for constant in kept}
    others = [constant for constant in constants if id(constant) not in ids]
    firsts = {id(c._values): c for c in reversed(others)}.values()  # copies sharing values: the first one placed
    new = [
        (id(c), int(c._values.nbytes), isinstance(c._values, np.ndarray) and not _packed_array(c._values))
        for c in firsts
        if c._values.nbytes >= INLINE_BELOW
    ]
    if new and sidecar.stat().st_nlink > 1:  # shared with another graph (_share_weights): never written into
        return None
    used = [(c._values.offset, c._values.offset + c._values.length) for c in kept]
    layout = plan_layout(sidecar.stat().st_size, used, _still_read(others, sidecar), new, ir.DEAD_AT_MOST)
    logger.debug(
        "%s: %d weights kept in place, %s",
        sidecar.name,
        len(kept),
        layout.described if layout else "too much unread: rewritten whole",
    )
    return None if layout is None else (ids, layout.placed)


def _still_read(constants: list[gs.Constant], sidecar: Path) -> list[tuple[int, int]]:
    """The ranges of `sidecar` that values still to be written read: a converted weight's source, an array mapped
    from it (a pass's view of a weight)."""
    ranges = []
    for constant in constants:
        values = constant._values
        source = values.source if isinstance(values, ConvertedValues) else values
        if isinstance(source, MappedValues) and ir.same_file(source.file, sidecar):
            ranges.append((source.offset, source.offset + source.length))
        base = source
        while isinstance(base, np.ndarray):
            if isinstance(base, np.memmap) and base.filename and ir.same_file(base.filename, sidecar):
                ranges.append((base.offset, base.offset + base.nbytes))
            base = base.base
    return ranges


def _packed_array(values: object) -> bool:
    if not isinstance(values, np.ndarray):
        return False
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(values.dtype) in PACKED
    except (KeyError, ValueError, TypeError):
        return False


def _renamed(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    renamed = onnx.TensorProto()
    renamed.CopyFrom(tensor)
    renamed.name = name
    return renamed


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

    attach_module_paths(model, metadata)


def _replace(path: Path, structure: bytes, weights: Path | None) -> None:
    """The structure and its weights into place together: neither is renamed until both are written."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(structure)
    if weights is not None:
        os.replace(weights, external_data_path(path))
    os.replace(partial, path)


def without_references(path: Path) -> None:
    """The graph at `path` made to hold every weight it reads from a checkpoint's files (written as fp32), and its
    links to them removed: what an artifact ships never refers outside itself."""
    links = checkpoint_links_path(path)
    if not links.is_dir():
        return
    if path.is_file() and holds_references(onnx.load(str(path), load_external_data=False)):
        with mapped(path) as (graph, structure):
            save_mapped(graph, path, module_paths_recorded(structure))
    shutil.rmtree(links)
