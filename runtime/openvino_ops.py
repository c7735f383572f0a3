"""Two ONNX ops as OpenVINO's ONNX frontend should read them for a decoder's graph, given to it as conversion
extensions (openvino.frontend.onnx.ConversionExtension: a node in, OpenVINO ops out).

- **TensorScatter** (opset 24, the static KV cache's in-place write, passes/static_cache.py), which OpenVINO 2026.4's
  frontend lacks ("No conversion rule found for operations: TensorScatter-24"): ScatterElementsUpdate along the
  cache's sequence axis, row b's new entries at write_indices[b] onwards. OpenVINO returns the updated cache as a
  new tensor, which the runtime copies back into its slots (runtime/kv_cache.py's StaticCacheSession).
- **Attention** (opset 23) with fewer key/value heads than query heads: the frontend's own translation repeats
  the keys and values per query head (a Tile of the whole cache every step: 89 of 267 ms of a 24-row decode step
  of SmolLM-135M's shape, 3 key/value heads for 9 query heads). Here each key/value head's query heads are one
  batch of the products instead: Q [b, kv, groups, s, d] against K [b, kv, 1, cache, d], broadcast, not copied.

TensorScatter is given for every model (OpenVINO has none). The Attention translation is given only for a static-cache
decoder, whose Attention nodes are the ones passes/attention.py writes (4-D q, k and v, one output, a scale, an
additive or boolean mask): elsewhere OpenVINO's own translation keeps the forms this one does not take (is_causal,
past inputs, 3-D inputs, more outputs), which are refused here with one line naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import openvino

OPTIONAL_INPUTS = {4: "past_key", 5: "past_value", 6: "nonpad_kv_seqlen"}  # Attention's, not taken here
RANK = 4  # [batch, heads, sequence, head_dim]
UNSUPPORTED = "not converted for OpenVINO"  # runtime/openvino_backend.py finds the refusal by it


def conversion_extensions(grouped_attention: bool) -> list[Any]:
    """The extensions to add to an openvino.Core before it reads a model; `grouped_attention` for a static-cache
    decoder's graph."""
    from openvino.frontend.onnx import ConversionExtension

    extensions = [ConversionExtension("TensorScatter", tensor_scatter)]
    return extensions + ([ConversionExtension("Attention", attention)] if grouped_attention else [])


def _given(node: Any, index: int) -> bool:
    """Whether optional input `index` is there (not absent, not an empty name)."""
    return node.get_input_size() > index and node.get_input(index).get_node().get_type_name() != "NullNode"


def _constant(values: Any) -> openvino.Node:
    import openvino.opset15 as ops

    return ops.constant(np.array(values, np.int64))


def tensor_scatter(node: Any) -> list[openvino.Output]:
    """present = past with update[b, ..., j, ...] written at past[b, ..., write_indices[b] + j, ...] (`linear`
    mode; `circular`'s wrap-around is not written by the passes and refused)."""
    import openvino.opset15 as ops

    mode = node.get_attribute("mode", "linear")
    if mode != "linear":
        raise ValueError(f"TensorScatter mode '{mode}': {UNSUPPORTED} (only 'linear'; use backend='onnxruntime')")
    past, update = node.get_input(0), node.get_input(1)
    rank = past.get_partial_shape().rank.get_length()
    axis = node.get_attribute("axis", -2) % rank
    update_shape = ops.shape_of(update, "i64")
    length = ops.squeeze(ops.gather(update_shape, _constant([axis]), _constant(0)), _constant(0))
    offsets = ops.range(_constant(0), length, _constant(1), "i64")
    along = [1] * rank
    along[axis] = -1
    offsets = ops.reshape(offsets, _constant(along), special_zero=False)
    if _given(node, 2):  # absent: every row writes from slot 0
        starts = ops.reshape(ops.convert(node.get_input(2), "i64"), _constant([-1] + [1] * (rank - 1)), False)
        offsets = ops.add(starts, offsets)
    indices = ops.broadcast(offsets, update_shape)
    return [ops.scatter_elements_update(past, indices, update, _constant(axis)).output(0)]


def _refuse_unless(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"Attention {what}: {UNSUPPORTED} (use backend='onnxruntime')")


def attention(node: Any) -> list[openvino.Output]:
    """softmax(scale · Q Kᵀ + mask) V with the query heads grouped by the key/value head they read."""
    import openvino.opset15 as ops

    query, key, value = node.get_input(0), node.get_input(1), node.get_input(2)
    _refuse_unless(query.get_partial_shape().rank.get_length() == RANK, "with 3-D inputs")
    for index, name in OPTIONAL_INPUTS.items():
        _refuse_unless(not _given(node, index), f"with input {name}")
    _refuse_unless(node.get_attribute("is_causal", 0) == 0, "with is_causal")
    _refuse_unless(node.get_attribute("softcap", 0.0) == 0.0, "with softcap")
    _refuse_unless(node.get_attribute("qk_matmul_output_mode", 0) == 0, "with qk_matmul_output_mode")
    query_heads, key_heads = _heads(node, query, "q_num_heads"), _heads(node, key, "kv_num_heads")
    groups, remainder = divmod(query_heads, key_heads)
    _refuse_unless(remainder == 0, "whose query heads are not a multiple of its key/value heads")
    query_shape = ops.shape_of(query, "i64")
    batch, length, head_dim = (ops.gather(query_shape, _constant([axis]), _constant(0)) for axis in (0, 2, 3))
    grouped = ops.concat([batch, _constant([key_heads, groups]), length, head_dim], 0)
    scale = float(node.get_attribute("scale")) if node.has_attribute("scale") else 1 / np.sqrt(_head_dim(query))
    query = ops.reshape(query, grouped, special_zero=False)
    if scale != 1.0:  # the passes fold the scale into the query projection: 1.0 there
        query = ops.multiply(query, ops.convert_like(ops.constant(np.array(scale, np.float32)), query))
    head_axis = _constant(2)
    scores = ops.matmul(query, ops.unsqueeze(key, head_axis), transpose_a=False, transpose_b=True)
    boolean = _given(node, 3) and node.get_input(3).get_element_type().get_type_name() == "boolean"
    if _given(node, 3):
        scores = ops.add(scores, _grouped_mask(node.get_input(3), scores, query_heads, key_heads))
    probabilities = ops.softmax(scores, -1)
    if boolean:  # a row that sees no key: softmax of -inf everywhere is NaN, which the spec makes zeros
        zero = ops.convert_like(ops.constant(np.array(0.0, np.float32)), probabilities)
        probabilities = ops.select(ops.is_nan(probabilities), zero, probabilities)
    weighted = ops.matmul(probabilities, ops.unsqueeze(value, head_axis), transpose_a=False, transpose_b=False)
    heads_first = ops.concat([batch, _constant([query_heads]), length, _constant([-1])], 0)  # v's own head size
    return [ops.reshape(weighted, heads_first, special_zero=False).output(0)]


def _heads(node: Any, tensor: openvino.Output, attribute: str) -> int:
    """A head count: the node's attribute (the passes write both), else the input's static dim 1."""
    if node.has_attribute(attribute):
        return int(node.get_attribute(attribute))
    heads = tensor.get_partial_shape()[1]
    _refuse_unless(heads.is_static, f"without {attribute} and with a dynamic head count")
    return int(heads.get_length())


def _head_dim(query: openvino.Output) -> int:
    """The query's head size, for Attention's default scale 1/sqrt(head_dim)."""
    head_dim = query.get_partial_shape()[3]
    _refuse_unless(head_dim.is_static, "without a scale and with a dynamic head size")
    return int(head_dim.get_length())


def _grouped_mask(mask: openvino.Output, scores: openvino.Node, query_heads: int, key_heads: int) -> openvino.Node:
    """The mask broadcast against [b, kv, groups, s, cache]: one for every head gets a groups axis, one per query
    head has its heads axis split as the queries were; boolean (True attends) as 0 / -inf."""
    import openvino.opset15 as ops

    shape = mask.get_partial_shape()
    _refuse_unless(shape.rank.is_static and shape.rank.get_length() <= RANK, "with a mask of unknown or >4 dims")
    rank = shape.rank.get_length()
    if rank > 2:  # its heads axis: 1 of 4, 0 of 3
        heads = shape[rank - 3]
        _refuse_unless(heads.is_static and heads.get_length() in (1, query_heads), "with a mask of other heads")
        if heads.get_length() == 1:
            mask = ops.unsqueeze(mask, _constant(rank - 2)).output(0)
        else:
            sizes = ops.shape_of(mask, "i64")
            leading = [ops.gather(sizes, _constant(list(range(rank - 3))), _constant(0))] if rank == RANK else []
            trailing = ops.gather(sizes, _constant([rank - 2, rank - 1]), _constant(0))
            split = ops.concat([*leading, _constant([key_heads, query_heads // key_heads]), trailing], 0)
            mask = ops.reshape(mask, split, special_zero=False).output(0)
    if mask.get_element_type().get_type_name() == "boolean":
        zero = ops.constant(np.array(0.0, np.float32))
        hidden = ops.constant(np.array(-np.inf, np.float32))
        mask = ops.select(mask, zero, hidden).output(0)
    return ops.convert_like(mask, scores)
