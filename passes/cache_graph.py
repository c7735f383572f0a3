"""Graph facts the static KV cache pass reads: where the cache is cast, what reads a past's length, and the
masked attention scores of attention written out as MatMul/Softmax/MatMul (DeepSeek's latent attention, which ONNX
Attention does not take: compiler/frontend/latent_attention.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs


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


def dtype_name(dtype: Any) -> str:
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


def reads_no_length(node: gs.Node) -> bool:
    """A Shape of dims that exclude the sequence's (axis 2): the exporter takes the batch size from a past."""
    if node.op != "Shape":
        return False
    start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
    return end is not None and (int(end) <= 2 or start >= 3) and start >= 0 and int(end) > 0
