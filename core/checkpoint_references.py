"""Weights a graph reads from its checkpoint's own files: the fused graph of a large decoder stores none.

A bf16 checkpoint's fp32 graph is twice the checkpoint on disk (at Qwen2.5-14B's shape 59 GB beside the 29.5 GB
checkpoint: more than a 45 GB disk holds) and every layerwise run reads it twice as wide as its values. Where the
checkpoint's files can be hard-linked beside the graph, each weight the export took unchanged from the checkpoint is
stored as a reference to its bytes there, in a form ONNX Runtime runs as it is:

    <weight>.checkpoint (the stored type and shape; external data in .<graph>.checkpoint/<shard>)
        -> Transpose (a Linear's weight: [out, in] as stored)  -> Cast(to=FLOAT)  -> <weight>

The nodes are named REFERENCE_NODE/<weight>. Widening bf16 or fp16 to fp32 is exact: every value is the one the fp32
graph held. ONNX Runtime refuses a symbolic link out of the model's directory, so the links are hard links: the same
file system only (elsewhere the graph stores its weights, as before).

In memory the passes see an fp32 weight (`ReferencedValues`: read, widened and transposed when loaded), so none of
them knows; `save_mapped` writes it back as a reference where asked (the fused graph saved over itself), else as
fp32 bytes (a variant, a shipped model.onnx: an artifact never refers outside itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx_graphsurgeon.ir.tensor import LazyValues

from tensorsmith.core.files import write_array
from tensorsmith.runtime.manifest import checkpoint_links_path

logger = logging.getLogger(__name__)

REFERENCE_NODE = "checkpoint_reference"
# an onnx-ir weight's meta key: (its Reference, a check of its values to run once before it is first written, or None)
REFERENCE_KEY = "tensorsmith.checkpoint_reference"
STORED_SUFFIX = ".checkpoint"
# the stored types a reference widens (exactly) to float32; a float64 checkpoint's weights are written as before
WIDENED = {"BF16": onnx.TensorProto.BFLOAT16, "F16": onnx.TensorProto.FLOAT16, "F32": onnx.TensorProto.FLOAT}
ROWS_BLOCK = 64 << 20  # bytes of float32 values written at a time when a reference is written out as fp32
TILE = 256  # of a transposed weight copied at a time (64 to 1024 measured alike; 32 and below slower)


@dataclass(frozen=True)
class Reference:
    """A weight's bytes in a checkpoint file: `file` (a link beside the graph, or the checkpoint's own), the
    stored type (ONNX's code) and shape, and the transpose that makes the graph's weight (None: as stored)."""

    file: Path
    offset: int
    length: int
    stored: int
    shape: tuple[int, ...]
    perm: tuple[int, ...] | None = None

    @property
    def graph_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[axis] for axis in self.perm) if self.perm else self.shape

    def transposed(self, perm: Iterable[int]) -> Reference:
        """The reference read through a Transpose of `perm` (composed with its own)."""
        perm = tuple(perm)
        return replace(self, perm=tuple(self.perm[axis] for axis in perm) if self.perm else perm)

    def stored_values(self) -> np.ndarray:
        """The bytes as stored, mapped (copy-on-write)."""
        bf16 = self.stored == onnx.TensorProto.BFLOAT16  # read as its bits: numpy has no bfloat16
        dtype = np.uint16 if bf16 else onnx.helper.tensor_dtype_to_np_dtype(self.stored)
        return np.memmap(self.file, dtype=dtype, mode="c", offset=self.offset, shape=self.shape)

    def values(self, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """The graph's weight (rows [start, stop) of its axis 0, where given) as float32."""
        stored = self.stored_values()
        bf16 = self.stored == onnx.TensorProto.BFLOAT16
        if self.perm == (1, 0):  # a Linear's weight: columns of the stored matrix, copied a tile at a time
            widened = _transposed(stored[:, start:stop], np.uint32 if bf16 else np.float32)
        else:
            arranged = np.transpose(stored, self.perm) if self.perm else stored
            part = arranged[start:stop] if start is not None else arranged
            widened = part.astype(np.uint32 if bf16 else np.float32, order="C")
        if bf16:  # bf16 is float32's upper half: shifted in place, exact
            widened <<= 16
        return widened.view(np.float32)


def _transposed(matrix: np.ndarray, dtype: type) -> np.ndarray:
    """`matrix`.T as a C-ordered array of `dtype`, TILE x TILE at a time: numpy's copy of a whole transpose reads a
    cache line for every value (0.94 s against 0.20 s for a [4096, 14336] bf16 weight)."""
    rows, columns = matrix.shape
    out: np.ndarray = np.empty((columns, rows), dtype)
    for i in range(0, rows, TILE):
        for j in range(0, columns, TILE):
            out[j : j + TILE, i : i + TILE] = matrix[i : i + TILE, j : j + TILE].T
    return out


class ReferencedValues(LazyValues):
    """An fp32 weight an onnx-graphsurgeon pass sees whose bytes are a checkpoint's (read when loaded)."""

    def __init__(self, reference: Reference, name: str) -> None:
        # LazyValues' own __init__ reads a TensorProto's shape and type: these values are only read when loaded
        self.reference, self.name = reference, name
        self.shape, self.dtype = reference.graph_shape, np.dtype(np.float32)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * 4

    def load(self) -> np.ndarray:
        return self.reference.values()

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.reference.values(start, stop)

    def write(self, stream: BinaryIO, name: str) -> onnx.TensorProto:
        """The fp32 values written a block of rows at a time; the tensor (no data) they are."""
        shape = self.reference.graph_shape
        rows = shape[0] if shape else 1
        step = max(1, ROWS_BLOCK // max(1, self.nbytes // max(1, rows)))
        for start in range(0, rows, step):
            write_array(self.rows(start, min(rows, start + step)), stream)
        return onnx.TensorProto(name=name, dims=list(shape), data_type=onnx.TensorProto.FLOAT)

    @property
    def tensor(self) -> onnx.TensorProto:
        """What onnx-graphsurgeon exports for lazy values: the fp32 values (save_mapped writes references itself)."""
        return onnx.numpy_helper.from_array(self.load(), self.name)


def link_beside(graph: Path, file: Path) -> Path | None:
    """`file` hard-linked into checkpoint_links_path(graph) (an existing link to it kept); None where it cannot be."""
    directory = checkpoint_links_path(graph)
    linked = directory / file.name
    try:
        if linked.exists() and os.path.samefile(linked, file):
            return linked
        directory.mkdir(exist_ok=True)
        linked.unlink(missing_ok=True)
        os.link(file, linked)
    except OSError as err:  # another file system, or one without hard links
        logger.debug("%s not linked beside %s: %s", file, graph, err)
        return None
    return linked


def can_link(graph: Path, file: Path) -> bool:
    """Whether `file` can be hard-linked beside the graph to be written at `graph` (tried, then removed)."""
    directory = checkpoint_links_path(graph)
    existed = directory.exists()
    linked = link_beside(graph, file)
    if linked is not None and not existed:
        linked.unlink()
        directory.rmdir()
    return linked is not None


def reference_form(name: str, reference: Reference, graph: Path) -> tuple[onnx.TensorProto, list[onnx.NodeProto]]:
    """The stored initializer and the nodes that make weight `name` of it, for the graph saved at `graph` (its
    file linked beside it). An OSError where it cannot be linked."""
    linked = link_beside(graph, reference.file)
    if linked is None:
        raise OSError(f"{reference.file} cannot be linked beside {graph}")
    nodes: list[onnx.NodeProto] = []
    as_stored = reference.perm is None and reference.stored == onnx.TensorProto.FLOAT  # no node to make it
    stored_name = name if as_stored else name + STORED_SUFFIX
    current = stored_name
    if reference.perm is not None:
        made = name if reference.stored == onnx.TensorProto.FLOAT else f"{name}{STORED_SUFFIX}.transposed"
        nodes.append(
            onnx.helper.make_node(
                "Transpose", [current], [made], name=f"{REFERENCE_NODE}/{name}/Transpose", perm=list(reference.perm)
            )
        )
        current = made
    if reference.stored != onnx.TensorProto.FLOAT:
        nodes.append(
            onnx.helper.make_node(
                "Cast", [current], [name], name=f"{REFERENCE_NODE}/{name}/Cast", to=onnx.TensorProto.FLOAT
            )
        )
    stored = onnx.TensorProto(name=stored_name, dims=list(reference.shape), data_type=reference.stored)
    stored.data_location = onnx.TensorProto.EXTERNAL
    location = linked.relative_to(graph.parent).as_posix()
    for key, value in (("location", location), ("offset", str(reference.offset)), ("length", str(reference.length))):
        stored.external_data.add(key=key, value=value)
    return stored, nodes


def write_references(model: onnx.ModelProto, references: dict[str, Reference], graph: Path) -> None:
    """Replace each initializer of `model` named in `references` (a placeholder) by its reference form, for the
    graph saved at `graph`; the nodes go first (they read initializers only)."""
    if not references:
        return
    kept = [tensor for tensor in model.graph.initializer if tensor.name not in references]
    nodes: list[onnx.NodeProto] = []
    stored: list[onnx.TensorProto] = []
    for name, reference in references.items():
        tensor, made = reference_form(name, reference, graph)
        stored.append(tensor)
        nodes += made
    del model.graph.initializer[:]
    model.graph.initializer.extend([*kept, *stored])
    rest = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend([*nodes, *rest])


def take_references(model: onnx.ModelProto, base: Path) -> dict[str, Reference]:
    """The weights `model` (its structure, saved in `base`) reads by reference, by name; their nodes and stored
    initializers are taken out of `model`, so that each weight is a value no node makes (onnx-graphsurgeon's
    importer leaves it a Variable for the caller to make a constant of)."""
    graph = model.graph
    stored = {tensor.name: tensor for tensor in graph.initializer if _is_reference(tensor)}
    if not stored:
        return {}
    found = {name: _reference(tensor, base) for name, tensor in stored.items()}
    for node in [node for node in graph.node if node.name.startswith(f"{REFERENCE_NODE}/")]:
        reference = found.pop(node.input[0])
        if node.op_type == "Transpose":
            perm = next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "perm")
            reference = reference.transposed(perm)
        found[node.output[0]] = reference
        graph.node.remove(node)
    names = set(stored)
    remaining = [tensor for tensor in graph.initializer if tensor.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(remaining)
    return found


def holds_references(model: onnx.ModelProto) -> bool:
    return any(_is_reference(tensor) for tensor in model.graph.initializer)


def held_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes a session holds for initializer `tensor`: a reference's are widened to float32 when the session
    folds its Cast (an 8B layer's 436 MB of bf16 are 872 MB held), anything else's as stored."""
    if _is_reference(tensor) and tensor.data_type != onnx.TensorProto.FLOAT:
        return 4 * int(np.prod(tensor.dims, dtype=np.int64))
    external = {entry.key: entry.value for entry in tensor.external_data}
    if "length" in external:
        return int(external["length"])
    return len(tensor.raw_data) or tensor.ByteSize()


def _is_reference(tensor: onnx.TensorProto) -> bool:
    """An initializer whose bytes are in a links directory (relative to its graph, or by absolute path)."""
    location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
    folder = Path(location).parent.name
    linked = folder.startswith(".") and folder.endswith(STORED_SUFFIX)
    return tensor.data_location == onnx.TensorProto.EXTERNAL and linked


def _reference(tensor: onnx.TensorProto, base: Path) -> Reference:
    fields = {entry.key: entry.value for entry in tensor.external_data}
    return Reference(
        base / fields["location"],
        int(fields.get("offset", 0)),
        int(fields["length"]),
        tensor.data_type,
        tuple(int(dim) for dim in tensor.dims),
    )


def linked_bytes(graph: Path) -> int:
    """The bytes of the checkpoint files linked beside the graph at `graph` (0: none)."""
    directory = checkpoint_links_path(graph)
    return sum(path.stat().st_size for path in directory.iterdir()) if directory.is_dir() else 0
