"""Graph facts the static KV cache pass reads: where the cache is cast, what reads a past's length, and the
masked attention scores of attention written out as MatMul/Softmax/MatMul (DeepSeek's latent attention, which ONNX
Attention does not take: compiler/frontend/latent_attention.py); and what the pass reports."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import PassDetails

# A graphsurgeon tensor's dtype: numpy's, or ONNX's number for a type numpy has not (bfloat16, fp8)
GraphDtype: TypeAlias = np.dtype | type[np.generic] | int


class StaticCacheDetails(PassDetails):
    """What the static KV cache pass (passes/static_cache.py) made."""

    windows: list[int]  # the layers' sliding windows (none: every layer sees every slot)
    cache_dtype: str
    capacity: int | str  # slots a row's cache holds, or its symbolic dim: the request's length


def masked_scores(graph: gs.Graph, mask: gs.Tensor, tokens: gs.Tensor) -> list[tuple[gs.Node, int]]:
    """Each Softmax's input `Add(scores, m)` where `m` is computed from `mask` and not from the tokens' values
    (the scores are, and past the first layer they derive from the mask too): the Add and the index of `m`."""
    from_mask, from_tokens = _computed_from(mask), _computed_from(tokens, through_shapes=False)
    found = []
    for node in graph.nodes:
        add = node.inputs[0].inputs[0] if node.op == "Softmax" and node.inputs[0].inputs else None
        if add is None or add.op != "Add":
            continue
        is_mask = [id(tensor) in from_mask and id(tensor) not in from_tokens for tensor in add.inputs]
        if is_mask.count(True) == 1:
            found.append((add, is_mask.index(True)))
    return found


def _computed_from(source: gs.Tensor, through_shapes: bool = True) -> set[int]:
    """The ids of every tensor computed from `source` (with `through_shapes=False`, from its values: not through
    a Shape node, which reads only its dims)."""
    derived, frontier = {id(source)}, [source]
    while frontier:
        for node in frontier.pop().outputs:
            if node.op == "Shape" and not through_shapes:
                continue
            for output in node.outputs:
                if id(output) not in derived:
                    derived.add(id(output))
                    frontier.append(output)
    return derived


def dtype_name(dtype: GraphDtype) -> str:
    """numpy's name, or ONNX's for a type numpy has not (onnx-graphsurgeon keeps bfloat16 as ONNX's number)."""
    return onnx.TensorProto.DataType.Name(dtype).lower() if isinstance(dtype, int) else np.dtype(dtype).name


def replace_uses(old: gs.Tensor, new: gs.Tensor) -> None:
    for node in list(old.outputs):
        for index, tensor in enumerate(node.inputs):
            if tensor is old:
                node.inputs[index] = new


def cache_in_compute_dtype(past: gs.Variable, present: gs.Variable) -> None:
    """An fp16 variant keeps fp32 inputs and outputs, casting the cache at both ends (present = Cast(Concat(
    Cast(past), new))): the cache becomes fp16 itself, half the bytes held, read and written, and the Concat's
    output the present that Attention reads."""
    cast_out = present.inputs[0] if present.inputs else None
    if cast_out is None or cast_out.op != "Cast" or not cast_out.inputs[0].inputs:
        return
    inner = cast_out.inputs[0]
    concat = inner.inputs[0]
    cast_in = concat.inputs[0].inputs[0] if concat.op == "Concat" and concat.inputs[0].inputs else None
    if cast_in is None or cast_in.op != "Cast" or cast_in.inputs[0] is not past:
        return
    cast_out.outputs.clear()
    replace_uses(inner, present)
    concat.outputs[0] = present
    present.dtype = past.dtype = inner.dtype
    replace_uses(cast_in.outputs[0], past)


def reads_batch_only(node: gs.Node) -> bool:
    """A Shape of dim 0 alone: the exporter takes the batch size from the padding mask too (LFM2)."""
    return node.op == "Shape" and int(node.attrs.get("start", 0)) == 0 and node.attrs.get("end") == 1


def reads_no_length(node: gs.Node) -> bool:
    """A Shape of dims that exclude the sequence's (axis 2): the exporter takes the batch size from a past."""
    if node.op != "Shape":
        return False
    start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
    return end is not None and (int(end) <= 2 or start >= 3) and start >= 0 and int(end) > 0


def new_token_columns(mask: gs.Tensor, tokens: gs.Tensor) -> list[gs.Node]:
    """The Slices `mask[:, -S:]` with S the tokens' sequence length (linear attention's padding mask for the
    step's tokens: compiler/frontend/linear_attention.py), which the static cache reads at the new slots."""
    found = []
    for node in mask.outputs:
        if node.op != "Slice" or node.inputs[0] is not mask or len(node.inputs) < 4:
            continue
        ends, axes = _constant(node.inputs[2]), _constant(node.inputs[3])
        steps = _constant(node.inputs[4]) if len(node.inputs) > 4 else np.array([1])
        if ends is None or axes is None or steps is None or axes.size != 1 or int(axes.item()) not in (1, -1):
            continue
        if int(ends.item()) >= 2**31 - 1 and int(steps.item()) == 1 and _negated_length(node.inputs[1], tokens):
            found.append(node)
    return found


_PASS_THROUGH = ("Reshape", "Squeeze", "Unsqueeze", "Cast", "Identity")


def _constant(tensor: gs.Tensor) -> np.ndarray | None:
    return np.asarray(tensor.values) if isinstance(tensor, gs.Constant) else None


def _producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node that computes `tensor`'s value, past the nodes that only reshape or cast it."""
    node = tensor.inputs[0] if tensor.inputs else None
    while node is not None and node.op in _PASS_THROUGH:
        node = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
    return node


def _negated_length(tensor: gs.Tensor, tokens: gs.Tensor) -> bool:
    """Whether `tensor` is minus the tokens' sequence length (Neg, or Mul by -1, of it)."""
    node = _producer(tensor)
    if node is None:
        return False
    if node.op == "Neg":
        return _sequence_length(node.inputs[0], tokens)
    if node.op == "Mul":
        for index, operand in enumerate(node.inputs):
            value = _constant(operand)
            if value is not None and value.size == 1 and int(value.item()) == -1:
                return _sequence_length(node.inputs[1 - index], tokens)
    return False


def _sequence_length(tensor: gs.Tensor, tokens: gs.Tensor) -> bool:
    """Whether `tensor` is the tokens' dim 1: Shape(tokens, start=1, end=2) or Gather(Shape(tokens), 1)."""
    node = _producer(tensor)
    if node is None:
        return False
    if node.op == "Shape" and node.inputs[0] is tokens:
        return int(node.attrs.get("start", 0)) == 1 and node.attrs.get("end") == 2
    if node.op == "Gather" and node.inputs[0].inputs and node.inputs[0].inputs[0].op == "Shape":
        shape, index = node.inputs[0].inputs[0], _constant(node.inputs[1])
        full = int(shape.attrs.get("start", 0)) == 0 and shape.attrs.get("end") is None
        return shape.inputs[0] is tokens and full and index is not None and int(index.item()) == 1
    return False
