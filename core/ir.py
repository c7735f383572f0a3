"""Load, describe and save ONNX models; models over protobuf's 2 GB limit are saved with external data."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from tensorsmith.core.errors import ConfigError, ExportError
from tensorsmith.runtime.manifest import TensorRecord, external_data_path

if TYPE_CHECKING:
    import onnx_ir

logger = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 1
# Leave headroom below the limit: the graph and attributes are serialised beside the initialisers.
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - (64 << 20)
# Saved files keep their weights in `<name>.data` beside them above this: protobuf serialises large messages at
# ~100-250 MB/s here (a 650 MB graph: 2.5-6 s a save), onnx-ir writes external data at ~1 GB/s (0.65 s).
EXTERNAL_DATA_ABOVE = 128 << 20
INLINE_BELOW = 1024  # bytes: smaller weights stay in the protobuf (onnx-ir's threshold as save_ir uses it)
DEAD_AT_MOST = 0.02  # of a weights file a graph is saved over: bytes no weight reads any more, or it is rewritten


def load_onnx(path: Path) -> onnx.ModelProto:
    """Load an ONNX file (and its external data), with an error that names the file when it cannot."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist", hint="check the SOURCE path")
    try:
        model = onnx.load(str(path))
    except (DecodeError, OSError, ValueError, RuntimeError) as err:  # truncated or not protobuf, missing data
        raise ExportError(
            f"{path} is not a readable ONNX model: {err}",
            hint="the file may be truncated or not ONNX; re-export it",
        ) from err
    if not model.graph.node:
        raise ExportError(f"{path} holds no graph nodes", hint="the file may be truncated or not ONNX; re-export it")
    opset, newest = ai_onnx_opset(model), onnx.defs.onnx_opset_version()
    if opset > newest:
        raise ExportError(
            f"{path} uses ai.onnx opset {opset}; the installed onnx {onnx.__version__} knows opsets up to {newest}",
            hint="re-export it at a released opset (tensorsmith compiles to opset 20 by default)",
        )
    check_standard_ops(model, str(path))
    return model


def check_standard_ops(model: onnx.ModelProto, origin: str) -> None:
    """Every node of the ai.onnx domain (the main graph's and its subgraphs') is an op ONNX defines at the
    model's opset: a misspelt or made-up op fails here, before any work, naming the node."""
    opset = ai_onnx_opset(model)
    for node in _all_nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue  # other domains (com.microsoft, custom ops) are for ONNX Runtime to accept or refuse
        try:
            onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            raise ExportError(
                f"node '{node.name or node.output[0]}' of {origin} uses op '{node.op_type}', which ai.onnx opset "
                f"{opset} does not define",
                hint="check the op's name and the model's opset import; custom ops need their own domain",
            ) from None


SUBGRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)  # If, Loop, Scan bodies


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attribute in node.attribute:
            for subgraph in [attribute.g, *attribute.graphs] if attribute.type in SUBGRAPH_ATTRIBUTES else []:
                nodes += _all_nodes(subgraph)
    return nodes


def ai_onnx_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise ExportError("the model imports no ai.onnx opset", hint="re-export it with a standard exporter")


def weight_bytes(model: onnx.ModelProto) -> int:
    """The initializers' stored bytes: nearly all of a large model's size, summed without serializing it
    (ByteSize walks the whole message: 0.2 s for MiniLM's 90 MB)."""
    total = 0
    for tensor in model.graph.initializer:
        total += len(tensor.raw_data) or 4 * (len(tensor.float_data) + len(tensor.int32_data)) + 8 * len(
            tensor.int64_data
        )
    return total


def serialized(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes, or None over 2 GB (it then needs its weights in external data)."""
    if weight_bytes(model) > EXTERNAL_DATA_THRESHOLD:
        return None
    try:
        return model.SerializeToString()
    except ValueError:  # protobuf refuses over 2 GB: the weights count was short of the whole
        return None


def inline_bytes(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes with its weights inside, or None above EXTERNAL_DATA_ABOVE (saved with external data)."""
    return serialized(model) if weight_bytes(model) <= EXTERNAL_DATA_ABOVE else None


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """Save `model` to `path`; above EXTERNAL_DATA_ABOVE of weights they go to `<name>.data` beside it (written by
    onnx-ir, which leaves `model` as it was: onnx.save would move the weights out of the caller's proto)."""
    sidecar = external_data_path(path)
    sidecar.unlink(missing_ok=True)  # a model saved here before with its weights outside
    if (data := inline_bytes(model)) is not None:
        path.write_bytes(data)
        return
    import onnx_ir as ir

    save_ir(ir.from_proto(model), path)


def remove_onnx(path: Path) -> None:
    """Remove an ONNX file and its external data."""
    path.unlink(missing_ok=True)
    external_data_path(path).unlink(missing_ok=True)


def save_ir(model: onnx_ir.Model, path: Path) -> None:
    """Save an onnx-ir model as `save_onnx` saves a ModelProto (weights above EXTERNAL_DATA_ABOVE in `<name>.data`)."""
    import onnx_ir as ir

    sidecar = external_data_path(path)
    sidecar.unlink(missing_ok=True)
    weights = sum(
        value.const_value.nbytes
        for graph in model.graphs()
        for value in graph.initializers.values()
        if value.const_value is not None
    )
    if weights <= EXTERNAL_DATA_ABOVE:
        ir.save(model, path)
        return
    logger.debug("saving %s with its weights in %s", path.name, sidecar.name)
    ir.save(model, path, external_data=sidecar.name, size_threshold_bytes=INLINE_BELOW)


def same_file(one: str | Path, other: str | Path) -> bool:
    try:
        return os.path.samefile(one, other)
    except OSError:
        return False


def value_dims(value: onnx.ValueInfoProto) -> list[int | str]:
    """Sizes and dim names as written; a dim with neither (or written as -1 or 0) is named NAME_dimAXIS."""
    dims: list[int | str] = []
    if not value.type.tensor_type.HasField("shape"):
        return dims
    for axis, dim in enumerate(value.type.tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(int(dim.dim_value))
        else:
            dims.append(dim.dim_param or f"{value.name}_dim{axis}")
    return dims


def value_record(value: onnx.ValueInfoProto) -> TensorRecord:
    elem_type = value.type.tensor_type.elem_type
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name if elem_type else "unknown"
    return TensorRecord(name=value.name, dtype=dtype, shape=value_dims(value))


@dataclass(frozen=True)
class GraphIO:
    """A graph's inputs and outputs, as the manifest records them."""

    inputs: list[TensorRecord]
    outputs: list[TensorRecord]


def io_records(model: onnx.ModelProto) -> GraphIO:
    """The graph's real inputs (initialisers excluded) and its outputs, as manifest records."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [value_record(v) for v in model.graph.input if v.name not in initializers]
    return GraphIO(inputs, [value_record(v) for v in model.graph.output])
