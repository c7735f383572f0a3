"""The fp32 graph's narrow twin: the same computation, with every weight that 16 bits hold exactly stored in
bfloat16 (or float16) behind a Cast, for the sessions that only measure it.

A bf16 checkpoint's fp32 graph stores each weight twice as wide as its values need, and every ONNX Runtime session
the compiler opens to measure that graph (verification, the evaluation reference, AWQ's statistics pass, fp16's
range check) holds the fp32 weights whole: at the Llama-3.2-1B shape 4.4 GB of a 7-8 GB step, and the file's
4.9 GB while the session opens. The twin holds them at the checkpoint's width and casts each one where a node
reads it; ONNX Runtime's constant folding, which would fold the Casts back into fp32 weights, is off for its
sessions (`TWIN_DISABLED_OPTIMIZERS`). The values every node sees are the same: a Cast of a value bf16 holds
exactly is exact. Only the kernels may differ: a MatMul whose weight comes from a Cast is not prepacked, so its
sums may round otherwise in the last bits.

A Gather from a table (the token embedding) gathers the 16-bit rows and casts those, not the whole table.
`model.onnx`, what ships and what the cpu target is timed on, stays fp32: `twin_of` names a twin only while the
graph it was written from is unchanged (a decoder's model.onnx is rewritten into a generation graph later).

An fp16 variant has a twin of its own kind (`write_widened_twin`): its weights are already 16 bits, but ONNX
Runtime's CPU provider has no fp16 MatMul here, so a session over it converts every MatMul weight to fp32 when it
opens (5.2 GB at the 1B shape for 2.5 GB of fp16). The twin computes each such MatMul in fp32 from a Cast of its
fp16 weight and input, and casts the product back to fp16: what ONNX Runtime does itself, with the weights left
at 16 bits.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.core import twin_nodes
from tensorsmith.core.external_bytes import copy_bytes, external_bytes, is_external, point_to, write_narrow
from tensorsmith.core.twin_nodes import cast as _cast
from tensorsmith.core.twin_nodes import cast_after as _cast_after
from tensorsmith.runtime.manifest import external_data_path

logger = logging.getLogger(__name__)

# ConstantFolding would fold the Casts back into fp32 weights, and so would ONNX Runtime's own fp16-initializer fusion
TWIN_DISABLED_OPTIMIZERS = ("ConstantFolding", "FuseFp16InitializerToFp32NodeTransformer")
# bytes (a 0.5B-parameter checkpoint's): below, unprepacked MatMuls and the Casts cost more than the weights save
# (at the SmolLM-135M shape, INT4's statistics pass took 44 s against 30 and peaked 0.12 GB higher)
SAVES_AT_LEAST = 1 << 30
NARROW: dict[int, str] = {onnx.TensorProto.BFLOAT16: "_bf16", onnx.TensorProto.FLOAT16: "_fp16"}


@dataclass(frozen=True)
class _Written:
    twin: Path
    signature: tuple[tuple[int, int, int], ...]  # of the graph it was written from, and its data


_TWINS: dict[str, _Written] = {}


def _signature(path: Path) -> tuple[tuple[int, int, int], ...]:
    parts = [path, external_data_path(path)]
    stats = [part.stat() for part in parts if part.is_file()]
    return tuple((stat.st_ino, stat.st_mtime_ns, stat.st_size) for stat in stats)


def twin_of(path: Path | str) -> Path | None:
    """The narrow twin written for the graph at `path`, while that graph is as it was then; else None."""
    path = Path(path)
    written = _TWINS.get(str(path.resolve()))
    if written is None:
        return None
    if not path.is_file() or _signature(path) != written.signature or not written.twin.is_file():
        _TWINS.pop(str(path.resolve()), None)
        return None
    return written.twin


def twin_directory(path: Path) -> Path:
    """Where the twin of the graph at `path` is written: a hidden directory beside it."""
    return path.parent / f".{path.name}.narrow-twin"


def write_twin(path: Path) -> Path | None:
    """Write the narrow twin of the graph saved at `path` into twin_directory(path) and remember it for twin_of;
    None (and nothing written) where it would save less than SAVES_AT_LEAST bytes."""
    structure = onnx.load(str(path), load_external_data=False)
    graph = structure.graph
    inputs = {value.name for value in graph.input}
    # what narrowing every fp32 weight would save, at most: below SAVES_AT_LEAST nothing is read nor written
    most = sum(
        external_bytes(tensor, path.parent).length // 2
        for tensor in graph.initializer
        if is_external(tensor) and tensor.data_type == onnx.TensorProto.FLOAT and tensor.name not in inputs
    )
    if most < SAVES_AT_LEAST:
        return None
    directory = twin_directory(path)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    twin = directory / path.name
    sidecar = external_data_path(twin)
    taken = {*inputs, *(t.name for t in graph.initializer), *(name for node in graph.node for name in node.output)}
    narrowed: dict[str, tuple[str, int]] = {}  # weight → (its 16-bit initializer, its type)
    saved = 0
    with sidecar.open("wb") as stream:
        for tensor in graph.initializer:
            if not is_external(tensor):
                continue
            stored = external_bytes(tensor, path.parent)
            source, offset, length = stored.file, stored.offset, stored.length
            written_at = stream.tell()
            narrowable = (
                tensor.data_type == onnx.TensorProto.FLOAT
                and tensor.name not in inputs
                and length % 4 == 0
                and not taken & {tensor.name + suffix for suffix in NARROW.values()}
            )
            kind = write_narrow(source, offset, length, stream) if narrowable else None
            if kind is None:  # as it is: its bytes copied
                copy_bytes(source, offset, length, stream)
                point_to(tensor, sidecar.name, written_at, length)
                continue
            narrowed[tensor.name] = (tensor.name + NARROW[kind], kind)
            tensor.name, tensor.data_type = narrowed[tensor.name][0], kind
            point_to(tensor, sidecar.name, written_at, length // 2)
            saved += length // 2
    if saved < SAVES_AT_LEAST:
        shutil.rmtree(directory)
        return None
    _cast_where_read(graph, narrowed)
    twin.write_bytes(structure.SerializeToString())
    _TWINS[str(path.resolve())] = _Written(twin, _signature(path))
    logger.debug("narrow twin of %s: %d weights in 16 bits, %.2f GB saved", path, len(narrowed), saved / 1e9)
    return twin


def write_widened_twin(path: Path) -> Path | None:
    """Write the twin of the fp16 graph saved at `path` whose MatMuls read their fp16 weights through Casts and
    compute in fp32, beside the graph (it reads the graph's own data file), and remember it for twin_of; None (and
    nothing written) where those weights are under SAVES_AT_LEAST bytes, which a session would otherwise hold
    twice over."""
    structure = onnx.load(str(path), load_external_data=False)
    graph = structure.graph
    weights = {tensor.name: tensor for tensor in graph.initializer if tensor.data_type == onnx.TensorProto.FLOAT16}
    transposed = twin_nodes.transposed_weights(graph, weights)  # a tied projection's table, through a Transpose
    readable = weights.keys() | transposed.keys()
    widened = [
        node
        for node in graph.node
        if node.op_type == "MatMul"
        and len(node.input) == 2
        and node.input[1] in readable
        and node.input[0] not in weights
    ]
    read = {transposed.get(node.input[1], node.input[1]) for node in widened}
    saved = sum(2 * int(np.prod(weights[name].dims)) for name in read)
    if saved < SAVES_AT_LEAST:
        return None
    nodes: list[onnx.NodeProto] = []
    cast_once: dict[str, str] = {}  # an fp16 value → its fp32 Cast (q, k and v read one input: cast once)
    targets = {id(node) for node in widened}
    for node in graph.node:
        if id(node) not in targets:
            nodes.append(node)
            continue
        (output,) = node.output
        source, weight = node.input
        if source not in cast_once:
            cast_once[source] = f"{source}/widened"
            nodes.append(_cast(source, cast_once[source]))
        if weight not in cast_once and weight in transposed:
            cast_once[weight] = f"{weight}/widened"
            nodes += twin_nodes.widened_transpose(weights[transposed[weight]], cast_once[weight], source)
        elif weight not in cast_once:
            cast_once[weight] = f"{weight}/widened"
            nodes += _cast_after(weights[weight], cast_once[weight], source)
        nodes.append(
            onnx.helper.make_node(
                "MatMul", [cast_once[source], cast_once[weight]], [f"{output}/widened"], name=node.name
            )
        )
        nodes.append(_cast(f"{output}/widened", output, onnx.TensorProto.FLOAT16))
    del graph.node[:]
    graph.node.extend(twin_nodes.unread_dropped(nodes, set(transposed), {output.name for output in graph.output}))
    twin = path.parent / f".{path.stem}.widened-twin{path.suffix}"
    twin.write_bytes(structure.SerializeToString())
    _TWINS[str(path.resolve())] = _Written(twin, _signature(path))
    logger.debug(
        "widened twin of %s: %d MatMuls in fp32 from 16-bit weights, %.2f GB held once", path, len(widened), saved / 1e9
    )
    return twin


def drop_twin(path: Path) -> None:
    """Forget and delete the twin of the graph at `path` (before the directory is published)."""
    written = _TWINS.pop(str(path.resolve()), None)
    if written is not None and written.twin.parent == path.parent:  # a widened twin, beside the graph
        written.twin.unlink(missing_ok=True)
    shutil.rmtree(twin_directory(path), ignore_errors=True)


def _cast_where_read(graph: onnx.GraphProto, narrowed: dict[str, tuple[str, int]]) -> None:
    """A Cast to float of each narrowed weight under its old name, tied to run just before the first node that
    reads it (_cast_after); first in the graph where no value a node makes reaches that node (or an output or a
    subgraph reads the weight). A Gather from one reads the 16-bit table and casts the rows it gathered instead."""
    tensors = {tensor.name: tensor for tensor in graph.initializer}
    at_start = {output.name for output in graph.output} | _read_by_subgraphs(graph)
    made: set[str] = set()  # values a node makes, so far
    cast: set[str] = set()  # weights whose Cast is written
    front: list[onnx.NodeProto] = []
    nodes: list[onnx.NodeProto] = []
    readers = Counter(name for node in graph.node for name in node.input)
    for node in graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else ""
        dims = tensors[narrowed[weight][0]].dims if weight in narrowed else []
        if (
            len(dims) == 2
            and weight not in at_start
            and readers[weight] == 1
            and node.input[0] in made
            and 4 * int(np.prod(dims)) > twin_nodes.SLICE_ABOVE
        ):
            nodes += twin_nodes.sliced_matmul(node, tensors[narrowed[weight][0]])
            cast.add(weight)
            made.update(node.output)
            continue
        table = node.input[0] if node.op_type == "Gather" and node.input else None
        if table in narrowed and table not in at_start:
            narrow, _ = narrowed[table]
            (output,) = node.output
            node.input[0], node.output[0] = narrow, f"{output}{narrow}"
            nodes += [node, _cast(f"{output}{narrow}", output)]
            made.update([*node.output, output])
            continue
        after = next((name for name in node.input if name in made), None)
        for name in node.input:
            if name not in narrowed or name in cast:
                continue
            cast.add(name)
            if after is None or name in at_start:
                front.append(_cast(narrowed[name][0], name))
            else:
                nodes += _cast_after(tensors[narrowed[name][0]], name, after)
        nodes.append(node)
        made.update(node.output)
    front += [_cast(narrowed[name][0], name) for name in sorted(at_start & narrowed.keys() - cast)]
    del graph.node[:]
    graph.node.extend([*front, *nodes])


def _read_by_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Every name a node's subgraph (If, Loop, Scan bodies) reads: outer values they may take."""
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                names.update(name for inner in body.node for name in inner.input)
                names |= _read_by_subgraphs(body)
    return names
