"""Every float tensor's range, measured in the same ONNX Runtime run as the graph's outputs.

The graph is read from its file without its external weights, which ONNX Runtime reads from beside it, and every
fp32 node output is reduced to its min and max inside the graph (ReduceMin and ReduceMax, as ONNX Runtime's
MinMaxCalibrater augments a graph): the session returns two scalars a tensor, and frees and reuses each
intermediate as it would for the graph alone, so memory stays that of one fp32 run whatever the number of tensors.
Verification runs the graph this way where the compile will need the ranges (the fp16 variant's range check,
compiler/variants/fp16_range.py): one session over the fp32 weights instead of two.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.core.checkpoint_references import REFERENCE_NODE
from tensorsmith.core.layerwise import LayerwiseSession, layerwise_segments
from tensorsmith.core.sessions import QUIET_SEVERITY, Session, measured_file, owned, quiet_onnxruntime

logger = logging.getLogger(__name__)

# ONNX Runtime's session option for a graph opened from bytes whose initializers are in external files
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
SUFFIXES = ("/fp16_range/min", "/fp16_range/max")


@dataclass(frozen=True)
class TensorRange:
    """A tensor's smallest and largest value on the feeds."""

    name: str
    low: float
    high: float


def float_node_outputs(graph: onnx.GraphProto) -> list[str]:
    """The node outputs of `graph` typed fp32 (value_info or graph outputs), in node order. Untyped ones are left out:
    a reduction of a bool or string tensor would not run."""
    floats = {
        value.name
        for value in [*graph.value_info, *graph.output]
        if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    # a weight read from its checkpoint (core/checkpoint_references.py) is no activation
    return [
        name
        for node in graph.node
        if not node.name.startswith(f"{REFERENCE_NODE}/")
        for name in node.output
        if name in floats
    ]


def outputs_and_ranges(path: Path, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[TensorRange]]:
    """The outputs of the ONNX file at `path` on `feeds` (in graph order) and the min and max of every fp32 node
    output, on ONNX Runtime's CPU provider, in one run."""
    opened, disabled = measured_file(path)  # the narrow twin where there is one: the weights in 16 bits
    model = onnx.load(str(opened), load_external_data=False)  # the weights stay in their file
    graph = model.graph
    names = float_node_outputs(graph)
    graph_outputs = [value.name for value in graph.output]
    taken = {name for node in graph.node for name in node.output} | {value.name for value in graph.input}
    reduced_names, nodes = [], []
    wanted = set(names)
    for node in graph.node:  # each reduction right after its tensor's node: a layerwise run keeps it in that layer
        nodes.append(node)
        for name in (output for output in node.output if output in wanted):
            for op, suffix in zip(("ReduceMin", "ReduceMax"), SUFFIXES, strict=True):
                reduced = f"{name}{suffix}"
                if reduced in taken:
                    continue
                # keepdims: an empty tensor reduces too (to ±inf, left out); no axes: over all of them, at any opset
                nodes.append(onnx.helper.make_node(op, [name], [reduced], name=reduced, keepdims=1))
                nodes[-1].metadata_props.extend(node.metadata_props)
                reduced_names.append(reduced)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in reduced_names)
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = QUIET_SEVERITY
    started = time.perf_counter()
    session: Session
    if (segment_bytes := layerwise_segments(opened)) is not None:
        session = LayerwiseSession(opened, segment_bytes, (), disabled, options, structure=model)
    else:
        options.add_session_config_entry(EXTERNAL_FOLDER, str(opened.parent))
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
        )
    del model, graph  # the session holds what it needs
    inputs = {value.name for value in session.get_inputs()}
    results = owned(session.run([*graph_outputs, *reduced_names], {k: v for k, v in feeds.items() if k in inputs}))
    values = dict(zip(reduced_names, results[len(graph_outputs) :], strict=True))
    logger.debug("ranges: %d tensors measured in %.2f s", len(names), time.perf_counter() - started)
    low, high = SUFFIXES
    ranges = [
        TensorRange(name, float(np.min(values[name + low])), float(np.max(values[name + high])))
        for name in names
        if name + low in values and name + high in values
    ]
    return results[: len(graph_outputs)], ranges


def tensor_ranges(path: Path, feeds: dict[str, np.ndarray]) -> list[TensorRange]:
    """The min and max of every fp32 node output of the ONNX file at `path` on `feeds`, in one run."""
    return outputs_and_ranges(path, feeds)[1]
