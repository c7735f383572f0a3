"""Activations that leave fp16's range, found on the fp32 graph before its fp16 variant is written.

fp16's largest value is 65504. Some checkpoints' residual streams reach the thousands to tens of thousands (the
"massive activations" of a few tokens), and an RMSNorm's squares of them far more: the fp16 variant would hold inf
there. So the fp32 graph runs once more on the verification feeds with every float node output reduced to its
min and max inside the graph (ReduceMin and ReduceMax, as ONNX Runtime's MinMaxCalibrater augments a graph): the
session returns two scalars a tensor, and ONNX Runtime frees and reuses each intermediate as it would for the
graph alone, so memory stays that of one fp32 run whatever the number of tensors (no intermediate is held, no
chunks are needed). The graph is read from its file without its external weights, which ONNX Runtime reads from
beside it: no copy of the weights is made. (MinMaxCalibrater itself takes a path, loads the weights into a
proto, writes two copies of them to disk, its shape-inferred and its augmented graph, and runs unoptimized.)

A tensor counts as out of range above an eighth of fp16's largest value (`ACTIVATION_LIMIT`, 8188): three
binades of headroom for inputs other than the verification feeds, whose token ids are all ones. On the two trained
checkpoints here, real text took the largest activations to 3.7x (tinylm) and 2.8x (all-MiniLM-L6-v2) what those
feeds gave, while the length did little (16 to 512 tokens: within 1.2x); a sum over the sequence (mean pooling)
grows with it, but from values far below. The residual stream's massive activations of real LLMs sit at the first
token whatever it is, so these feeds meet them. Its negative side at -1e9 or below is a mask (scores plus
finfo(float32).min or -1e9), which fp16's -65504 masks as well, and not a range to keep; non-finite values (an empty
tensor's reduction, the fp32 graph's own overflow) are left out.

The fp16 pass (passes/fp16.py, its regions decided in passes/half_regions.py) keeps the writers and readers of
the tensors found here in fp32.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.core.sessions import QUIET_SEVERITY, measured_file, quiet_onnxruntime
from tensorsmith.passes.half_float import FP16_MAX, INFINITY_STAND_IN
from tensorsmith.runtime.onnxruntime_backend import onnxruntime_reason

logger = logging.getLogger(__name__)

ACTIVATION_LIMIT = FP16_MAX / 8  # measured headroom: see above
# ONNX Runtime's session option for a graph opened from bytes whose initializers are in external files
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
SUFFIXES = ("/fp16_range/min", "/fp16_range/max")


@dataclass(frozen=True)
class TensorRange:
    """A tensor's smallest and largest value on the feeds."""

    name: str
    low: float
    high: float

    @property
    def magnitude(self) -> float:
        """Its largest |value| that a half type must hold: finite values only, and no mask below -1e9."""
        high = self.high if math.isfinite(self.high) else 0.0
        low = self.low if math.isfinite(self.low) and self.low > -INFINITY_STAND_IN else 0.0
        return max(high, -low, 0.0)


def float_node_outputs(graph: onnx.GraphProto) -> list[str]:
    """The node outputs of `graph` typed fp32 (value_info or graph outputs), in node order. Untyped ones are left out:
    a reduction of a bool or string tensor would not run."""
    floats = {value.name for value in [*graph.value_info, *graph.output]
              if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}  # fmt: skip
    return [name for node in graph.node for name in node.output if name in floats]


def tensor_ranges(path: Path, feeds: dict[str, np.ndarray]) -> list[TensorRange]:
    """The min and max of every fp32 node output of the ONNX file at `path` on `feeds`, on ONNX Runtime's CPU
    provider, in one run."""
    opened, disabled = measured_file(path)  # the narrow twin where there is one: the weights in 16 bits
    model = onnx.load(str(opened), load_external_data=False)  # the weights stay in their file
    graph = model.graph
    names = float_node_outputs(graph)
    taken = {name for node in graph.node for name in node.output} | {value.name for value in graph.input}
    outputs = []
    for name in names:
        for op, suffix in zip(("ReduceMin", "ReduceMax"), SUFFIXES, strict=True):
            reduced = f"{name}{suffix}"
            if reduced in taken:
                continue
            # keepdims: an empty tensor reduces too (to ±inf, left out); no axes: over all of them, at any opset
            graph.node.append(onnx.helper.make_node(op, [name], [reduced], name=reduced, keepdims=1))
            outputs.append(reduced)
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in outputs)
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = QUIET_SEVERITY
    options.add_session_config_entry(EXTERNAL_FOLDER, str(opened.parent))
    started = time.perf_counter()
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                           disabled_optimizers=disabled)  # fmt: skip
    del model, graph  # the session holds what it needs
    inputs = {value.name for value in session.get_inputs()}
    values = dict(zip(outputs, session.run(outputs, {k: v for k, v in feeds.items() if k in inputs}), strict=True))
    logger.debug("fp16 range: %d tensors measured in %.2f s", len(names), time.perf_counter() - started)
    low, high = SUFFIXES
    return [
        TensorRange(name, float(np.min(values[name + low])), float(np.max(values[name + high])))
        for name in names
        if name + low in values and name + high in values
    ]


def out_of_range_activations(
    path: Path, feeds: dict[str, np.ndarray], limit: float = ACTIVATION_LIMIT
) -> dict[str, float]:
    """The fp32 node outputs of the graph at `path` whose magnitude on `feeds` exceeds `limit`: name → max |x|, for
    `ConvertToFp16(out_of_range=...)`. Where ONNX Runtime cannot run the augmented graph, none (logged: only the
    weights are then checked)."""
    try:
        ranges = tensor_ranges(path, feeds)
    except Exception as err:  # onnxruntime's own exception types
        logger.warning("fp16: activations not checked against fp16's range: %s", onnxruntime_reason(err))
        return {}
    return {tensor.name: tensor.magnitude for tensor in ranges if tensor.magnitude > limit}
