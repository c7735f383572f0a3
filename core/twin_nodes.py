"""The nodes the twins (core/narrow_twin.py) are written with: Casts tied to run just before the node that reads
their weight, a large MatMul cut into slices of its weight's columns, and a tied projection's table widened then
transposed."""

from __future__ import annotations

import numpy as np
import onnx

# float32 bytes of a MatMul weight above which the twin casts it a slice of columns at a time (the 1B shape's
# vocabulary projection is 1.05 GB cast whole); SLICE_BYTES of it a slice
SLICE_ABOVE = 512 << 20
SLICE_BYTES = 128 << 20


def sliced_matmul(node: onnx.NodeProto, weight: onnx.TensorProto) -> list[onnx.NodeProto]:
    """`node`, a MatMul of a large 16-bit `weight` [K, N], as MatMuls of SLICE_BYTES of its columns at a time, each
    slice cast just before its product and the products concatenated: one slice's float32 copy alive at a time, not
    the whole weight's. Each slice's start is tied to the product before it (as `cast_after` ties a Cast), so that
    ONNX Runtime cannot cut every slice first."""
    source, (output,) = node.input[0], node.output
    rows, columns = (int(dim) for dim in weight.dims)
    step = max(1, SLICE_BYTES // (4 * rows))
    base = f"{output}/sliced"
    nodes = [_constant(f"{base}/axes", np.array([1], np.int64))]
    parts: list[str] = []
    previous = source
    for index, start in enumerate(range(0, columns, step)):
        at = f"{base}/{index}"
        nodes += [
            _constant(f"{at}/start", np.array([start], np.int64)),
            _constant(f"{at}/stop", np.array([min(columns, start + step)], np.int64)),
            *_tied(f"{at}/start", previous, f"{at}/tied"),
            onnx.helper.make_node(
                "Slice", [weight.name, f"{at}/tied", f"{at}/stop", f"{base}/axes"], [f"{at}/slice"], name=f"{at}/slice"
            ),
            cast(f"{at}/slice", f"{at}/weight"),
            onnx.helper.make_node("MatMul", [source, f"{at}/weight"], [f"{at}/product"], name=f"{at}/product"),
        ]
        parts.append(f"{at}/product")
        previous = f"{at}/product"
    nodes.append(onnx.helper.make_node("Concat", parts, [output], name=node.name or base, axis=-1))
    return nodes


def cast(source: str, output: str, to: int = onnx.TensorProto.FLOAT) -> onnx.NodeProto:
    return onnx.helper.make_node("Cast", [source], [output], name=f"{output}/narrow_twin_cast", to=to)


def cast_after(weight: onnx.TensorProto, output: str, after: str) -> list[onnx.NodeProto]:
    """A Cast to float of `weight` as `output` that cannot run before the value `after` exists. ONNX Runtime runs
    a node that reads weights only as early as it can: every weight's Cast would run first and hold every widened
    weight at once (a 1B graph's whole fp32 weights). Reshaping the weight to its own shape plus zero times
    `after`'s size ties its Cast to the node that reads it."""
    base = f"{output}/after"
    return [
        _constant(f"{base}/dims", np.array(weight.dims, np.int64)),
        *_tied(f"{base}/dims", after, f"{base}/shape"),
        onnx.helper.make_node("Reshape", [weight.name, f"{base}/shape"], [f"{base}/tied"], name=f"{base}/tied"),
        cast(f"{base}/tied", output),
    ]


def transposed_weights(graph: onnx.GraphProto, weights: dict[str, onnx.TensorProto]) -> dict[str, str]:
    """The outputs of 2-D Transposes of `weights` (a tied vocabulary projection's table: passes/tied_projection.py)
    → the weight each transposes."""
    found = {}
    for node in graph.node:
        if node.op_type != "Transpose" or not node.input or node.input[0] not in weights:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        if len(weights[node.input[0]].dims) == 2 and perm == [1, 0]:
            found[node.output[0]] = node.input[0]
    return found


def widened_transpose(table: onnx.TensorProto, output: str, after: str) -> list[onnx.NodeProto]:
    """The 16-bit `table` cast to float just before the value `after` is read (cast_after), then transposed as
    `output`: ONNX Runtime fuses that Transpose into the MatMul reading it (FusedMatMul, transB), holding no copy."""
    widened = f"{table.name}/widened"
    return [
        *cast_after(table, widened, after),
        onnx.helper.make_node("Transpose", [widened], [output], name=output, perm=[1, 0]),
    ]


def unread_dropped(nodes: list[onnx.NodeProto], droppable: set[str], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` without those whose one output is in `droppable` and read by no node nor graph output."""
    read = {name for node in nodes for name in node.input} | outputs
    return [node for node in nodes if not (node.output and node.output[0] in droppable and node.output[0] not in read)]


def _tied(value: str, after: str, output: str) -> list[onnx.NodeProto]:
    """`value` + 0 x Size(`after`) as `output`: the same int64 value, which cannot be computed before `after` exists."""
    return [
        _constant(f"{output}/zero", np.array(0, np.int64)),
        onnx.helper.make_node("Size", [after], [f"{output}/size"], name=f"{output}/size"),
        onnx.helper.make_node(
            "Mul", [f"{output}/size", f"{output}/zero"], [f"{output}/nothing"], name=f"{output}/nothing"
        ),
        onnx.helper.make_node("Add", [value, f"{output}/nothing"], [output], name=output),
    ]


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return onnx.helper.make_node("Constant", [], [name], name=name, value=onnx.numpy_helper.from_array(value, name))
