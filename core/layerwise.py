"""A saved graph run one group of layers at a time: the memory of a run is one group's weights and the values that
cross between groups, not the model's weights.

An ONNX Runtime session holds every weight of its graph from the moment it opens: at Llama-3.1-8B's shape the fp32
graph is 32 GB, more than the machine. `LayerwiseSession` cuts the graph's nodes, in their (topological) order,
into contiguous segments at the decoder layers' boundaries (a node's layer is the first numbered part of its module
path: `model.layers.7.mlp` → `model.layers.7`), joined until each holds at least `min_bytes` of weights. Any cut of
a topological order into contiguous runs is a valid one: a segment reads only graph inputs, its own initializers and
values earlier segments made. Each run opens one segment's session at a time (its structure is written beside the
graph, so that its weights are read from the graph's own external data file), runs every row through it, keeps the
values later segments or the caller need, and closes it. Model Optimizer's layerwise calibration works the same way
in PyTorch; this is the same on the graph every variant is measured on.

The outputs equal the whole graph's up to the last bits: ONNX Runtime fuses nothing across a cut (a residual Add
and the next layer's norm), so those sums may round otherwise. The object answers what the compiler asks of an ONNX
Runtime session (`run`, `get_inputs`, `get_outputs`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from tensorsmith.core.memory import available_memory, trim_heap
from tensorsmith.core.module_paths import MODULE_KEY, module_path_from_name
from tensorsmith.runtime.manifest import external_data_path

logger = logging.getLogger(__name__)
UNNAMED_SEGMENTS = 16  # a graph without module paths is cut into about this many segments of equal weight
_NUMBERED = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")  # the module path up to its first numbered part


@dataclass(frozen=True)
class Argument:
    """An input or output as ONNX Runtime's NodeArg describes it: name, shape (ints, dim names, None) and type."""

    name: str
    shape: list[int | str | None]
    type: str


@dataclass(frozen=True)
class Segment:
    nodes: list[onnx.NodeProto]
    inputs: list[str]  # graph inputs and earlier segments' values it reads
    outputs: list[str]  # values later segments or the graph's outputs read
    initializers: list[onnx.TensorProto]  # without their data: it stays in the graph's external data file
    weight_bytes: int


def layer_of(node: onnx.NodeProto) -> str | None:
    """The decoder layer (or any numbered module) `node` belongs to, from its module path; None where it has none."""
    path = next((entry.value for entry in node.metadata_props if entry.key == MODULE_KEY), None)
    if path is None and node.name.startswith("/"):
        path = module_path_from_name(node.name)
    match = _NUMBERED.match(path or "")
    return match.group(1) if match else None


def _read_names(node: onnx.NodeProto) -> set[str]:
    """Every value `node` reads, those its subgraphs (If, Loop, Scan) read from the enclosing scope included."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        graphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for graph in graphs:
            made = {name for inner in graph.node for name in inner.output} | {value.name for value in graph.input}
            made |= {tensor.name for tensor in graph.initializer}
            names |= {name for inner in graph.node for name in _read_names(inner)} - made
    return names


def _stored_bytes(tensor: onnx.TensorProto) -> int:
    external = {entry.key: entry.value for entry in tensor.external_data}
    if "length" in external:
        return int(external["length"])
    return len(tensor.raw_data) or tensor.ByteSize()


def _weights_beside_readers(graph: onnx.GraphProto, initializers: Iterable[str]) -> list[tuple[onnx.NodeProto, bool]]:
    """`graph`'s nodes in an order that is still topological, each node that reads weights only (a weight's
    DequantizeLinear or Transpose: ONNX Runtime folds them in a whole session) moved to just before its first
    reader, with whether it is one: a segment then holds the weights its own nodes read, not every layer's."""
    constant = set(initializers)
    weights_only = []
    for node in graph.node:
        alone = not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        weights_only.append(alone and all(name in constant for name in node.input if name))
        if weights_only[-1]:
            constant.update(node.output)
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    order: list[int] = []
    placed: set[int] = set()

    def place(index: int) -> None:
        if index in placed:
            return
        for name in graph.node[index].input:
            if name in producer and weights_only[producer[name]]:
                place(producer[name])
        placed.add(index)
        order.append(index)

    for index in range(len(graph.node)):
        if not weights_only[index]:
            place(index)
    for index in range(len(graph.node)):
        place(index)
    return [(graph.node[index], weights_only[index]) for index in order]


def segments(structure: onnx.ModelProto, min_bytes: int, wanted: Iterable[str] = ()) -> list[Segment]:
    """`structure`'s nodes cut at layer boundaries into segments of at least `min_bytes` of weights each (the last
    may hold less); `wanted`: values the caller asks for besides the graph's outputs."""
    graph = structure.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    order = _weights_beside_readers(graph, initializers.keys())
    layers = [layer_of(node) for node, _ in order]
    groups: list[list[onnx.NodeProto]] = []
    current: str | None = None
    waiting: list[onnx.NodeProto] = []  # nodes that read weights only, placed with the node that reads them
    for (node, weights_only), layer in zip(order, layers, strict=True):
        if weights_only:
            waiting.append(node)
            continue
        # a graph whose nodes name no module (a variant file: ONNX Runtime's own names) is cut by weight alone;
        # the nodes before the first layer (embedding, rotary tables, mask) go with it, those after with the last
        if not groups or (layer is not None and current is not None and layer != current) or not any(layers):
            groups.append([])
        current = layer if layer is not None else current
        groups[-1] += [*waiting, node]
        waiting = []
    if waiting:  # weights only, read by no node: a graph output
        groups.append(waiting) if not groups else groups[-1].extend(waiting)
    reads = [set().union(*(_read_names(node) for node in group)) for group in groups]
    weights = [sum(_stored_bytes(initializers[name]) for name in names if name in initializers) for names in reads]
    if not any(layers):
        min_bytes = max(min_bytes, sum(weights) // UNNAMED_SEGMENTS)
    joined: list[tuple[list[onnx.NodeProto], set[str], int]] = []
    for group, names, size in zip(groups, reads, weights, strict=True):
        if joined and joined[-1][2] < max(min_bytes, 1):  # a segment without weights joins the next
            nodes, read, held = joined[-1]
            joined[-1] = (nodes + group, read | names, held + size)
        else:
            joined.append((group, set(names), size))
    kept = {output.name for output in graph.output} | set(wanted)
    made_by = [{name for node in nodes for name in node.output if name} for nodes, _, _ in joined]
    read_later = [set().union(*(read for _, read, _ in joined[index + 1 :])) for index in range(len(joined))]
    result = []
    for (nodes, read, held), made, later in zip(joined, made_by, read_later, strict=True):
        inputs = sorted(read - made - initializers.keys())
        outputs = sorted(made & (later | kept))
        used = [initializers[name] for name in sorted(read) if name in initializers]
        result.append(Segment(nodes, inputs, outputs, used, held))
    return result


def _element_types(structure: onnx.ModelProto) -> dict[str, int]:
    """Every value's element type: ONNX's shape inference, then, for what it does not know (ONNX Runtime's
    contrib ops: MatMulNBits, GroupQueryAttention), the type of the node's first typed input."""
    inferred = onnx.shape_inference.infer_shapes(structure, strict_mode=False)
    graph = inferred.graph
    types = {tensor.name: tensor.data_type for tensor in graph.initializer}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for node in graph.node:
        first = next((types[name] for name in node.input if name in types), onnx.TensorProto.FLOAT)
        for name in node.output:
            types.setdefault(name, first)
    return types


def _argument(value: onnx.ValueInfoProto) -> Argument:
    tensor = value.type.tensor_type
    shape: list[int | str | None] = [dim.dim_value if dim.HasField("dim_value") else dim.dim_param or None
                                     for dim in tensor.shape.dim]  # fmt: skip
    numpy_type = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type) if tensor.elem_type else np.dtype(np.float32)
    return Argument(value.name, shape, f"tensor({_ORT_TYPES.get(np.dtype(numpy_type).name, 'float')})")


_ORT_TYPES = {"float32": "float", "float64": "double", "float16": "float16", "int64": "int64", "int32": "int32",
              "bool": "bool", "int8": "int8", "uint8": "uint8"}  # fmt: skip


# Layerwise runs: "auto" where a graph's weights exceed LAYERWISE_SHARE of the memory available
# when its session opens, in segments of LAYERWISE_SEGMENT_BYTES; "always", one layer a segment; "never".
Layerwise = Literal["auto", "always", "never"]
LAYERWISE_SHARE = 1 / 3
LAYERWISE_SEGMENT_BYTES = 512 << 20
_LAYERWISE = ["auto"]


@contextlib.contextmanager
def layerwise(mode: str) -> Iterator[None]:
    """Sessions that measure a saved graph run it a layer at a time as `mode` says, inside the block."""
    previous, _LAYERWISE[0] = _LAYERWISE[0], mode
    try:
        yield
    finally:
        _LAYERWISE[0] = previous


def layerwise_segments(path: Path) -> int | None:
    """The weight bytes each segment of a layerwise run over the graph at `path` holds at least (0: one layer
    each), or None where a session should hold the whole graph."""
    mode = _LAYERWISE[0]
    if mode == "never":
        return None
    if mode == "always":
        return 0
    data = external_data_path(path)
    stored = (data.stat().st_size if data.is_file() else 0) + path.stat().st_size
    available = available_memory()
    return LAYERWISE_SEGMENT_BYTES if available is not None and stored > available * LAYERWISE_SHARE else None


class LayerwiseSession:
    """An ONNX Runtime CPU session over the graph at `path`, run a segment at a time (the module's docstring)."""

    def __init__(
        self,
        path: Path,
        min_bytes: int,
        extra_outputs: Sequence[str] = (),
        disabled_optimizers: Sequence[str] = (),
        options: Any = None,  # onnxruntime.SessionOptions (the caller's: quiet)
        structure: onnx.ModelProto | None = None,
    ) -> None:
        """`structure`: the graph to run where it is not the file's own (its weights still read beside `path`)."""
        self.path = path
        self._options = options
        self._disabled = list(disabled_optimizers)
        structure = structure if structure is not None else onnx.load(str(path), load_external_data=False)
        self._structure = structure
        self._types = _element_types(structure)
        present = [output.name for output in structure.graph.output]
        self._outputs = [*present, *(name for name in extra_outputs if name not in present)]
        self.segments = segments(structure, min_bytes, self._outputs)
        logger.info("%s runs a layer at a time: %d segments, at most %.2f GB of weights each", path.name,
                    len(self.segments), max((s.weight_bytes for s in self.segments), default=0) / 1e9)  # fmt: skip
        initializers = {tensor.name for tensor in structure.graph.initializer}
        self._inputs = [value for value in structure.graph.input if value.name not in initializers]
        declared = {value.name: value for value in [*structure.graph.output, *structure.graph.value_info]}
        self._output_args = [_argument(declared.get(name, onnx.helper.make_tensor_value_info(name, self._types.get(
            name, onnx.TensorProto.FLOAT), None))) for name in self._outputs]  # fmt: skip

    def get_inputs(self) -> list[Argument]:
        return [_argument(value) for value in self._inputs]

    def get_outputs(self) -> list[Argument]:
        return list(self._output_args)

    def run(self, names: Sequence[str] | None, feeds: dict[str, np.ndarray], run_options: Any = None) -> list[Any]:
        """`names` (every output where None) on `feeds`, one segment's session open at a time."""
        wanted = list(names) if names else list(self._outputs)
        missing = [value.name for value in self._inputs if value.name not in feeds]
        if missing:  # as ONNX Runtime words it
            raise ValueError(f"Required inputs ({missing}) are missing from input feed ({list(feeds)}).")
        values: dict[str, Any] = {value.name: feeds[value.name] for value in self._inputs}
        for index, segment in enumerate(self.segments):
            session = self._open(segment)
            outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs}, run_options)
            del session
            values.update(zip(segment.outputs, (np.array(output) for output in outputs), strict=True))
            needed = set(wanted).union(*(later.inputs for later in self.segments[index + 1 :]))
            values = {name: value for name, value in values.items() if name in needed}
            trim_heap()  # the session's arena and weights, given back before the next segment's are read
        return [values[name] for name in wanted]

    def _open(self, segment: Segment) -> Any:
        import onnxruntime  # heavy: only where a session opens

        graph = onnx.helper.make_graph(
            segment.nodes,
            self._structure.graph.name or "segment",
            [self._value(name) for name in segment.inputs],
            [self._value(name) for name in segment.outputs],
            segment.initializers,
        )
        model = onnx.helper.make_model(graph, opset_imports=self._structure.opset_import,
                                       ir_version=self._structure.ir_version)  # fmt: skip
        model.functions.extend(self._structure.functions)
        # beside the graph, where its external data's relative locations resolve (ONNX Runtime refuses absolute ones)
        with tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=f".{self.path.stem}-segment-",
                                         suffix=".onnx") as written:  # fmt: skip
            written.write(model.SerializeToString())
            written.flush()
            return onnxruntime.InferenceSession(written.name, self._options, providers=["CPUExecutionProvider"],
                                                disabled_optimizers=self._disabled)  # fmt: skip

    def _value(self, name: str) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(name, self._types.get(name, onnx.TensorProto.FLOAT), None)
