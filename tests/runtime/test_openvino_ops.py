"""runtime/openvino_ops.py: TensorScatter and grouped-query Attention as OpenVINO reads them, each graph run on
OpenVINO and on ONNX Runtime (which has both ops natively) with the same feeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from tensorsmith.runtime import RuntimeLoadError, TensorSpec
from tensorsmith.runtime.openvino_backend import OpenVinoBackend, openvino_unavailable

needs_openvino = pytest.mark.skipif(openvino_unavailable() is not None, reason=str(openvino_unavailable()))
BATCH, QUERY_HEADS, KV_HEADS, CACHE, NEW, HEAD_DIM = 2, 6, 2, 16, 3, 8


def _value(name: str, dtype: int, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def cached_step_onnx(
    path: Path, mask_dtype: int, scale: float | None, value_dim: int = HEAD_DIM, mask_heads: int = 1
) -> Path:
    """A static-cache attention step: the new keys and values written into the caches at each row's write index
    (TensorScatter), then Attention of 6 query heads over the 2 key/value heads of the whole cache."""
    attrs: dict[str, object] = {"q_num_heads": QUERY_HEADS, "kv_num_heads": KV_HEADS}
    if scale is not None:
        attrs["scale"] = scale
    nodes = [
        helper.make_node("TensorScatter", ["past_key", "key", "write_indices"], ["present_key"], axis=-2),
        helper.make_node("TensorScatter", ["past_value", "value", "write_indices"], ["present_value"], axis=-2),
        helper.make_node("Attention", ["query", "present_key", "present_value", "mask"], ["y"], **attrs),
    ]
    key_cache, value_cache = [BATCH, KV_HEADS, CACHE, HEAD_DIM], [BATCH, KV_HEADS, CACHE, value_dim]
    graph = helper.make_graph(
        nodes, "cached_step",
        [_value("query", TensorProto.FLOAT, [BATCH, QUERY_HEADS, NEW, HEAD_DIM]),
         _value("key", TensorProto.FLOAT, [BATCH, KV_HEADS, NEW, HEAD_DIM]),
         _value("value", TensorProto.FLOAT, [BATCH, KV_HEADS, NEW, value_dim]),
         _value("past_key", TensorProto.FLOAT, key_cache), _value("past_value", TensorProto.FLOAT, value_cache),
         _value("write_indices", TensorProto.INT64, [BATCH]),
         _value("mask", mask_dtype, [BATCH, mask_heads, NEW, CACHE])],
        [_value("y", TensorProto.FLOAT, [BATCH, QUERY_HEADS, NEW, value_dim]),
         _value("present_key", TensorProto.FLOAT, key_cache), _value("present_value", TensorProto.FLOAT, value_cache)],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]), str(path))
    return path


def _specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    def spec(value: onnx.ValueInfoProto) -> TensorSpec:
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        return TensorSpec(
            value.name, np.dtype(dtype).name, tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
        )

    return [spec(value) for value in model.graph.input], [spec(value) for value in model.graph.output]


def _feeds(mask_dtype: int, value_dim: int = HEAD_DIM, mask_heads: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    write = np.array([2, 9])  # each row's new entries land at its own slots
    visible = np.arange(CACHE)[None, None, :] <= (write[:, None, None] + np.arange(NEW)[None, :, None])  # causal
    visible = np.repeat(visible[:, None], mask_heads, axis=1)  # [batch, heads, new, cache]
    if mask_heads > 1:
        visible[0, 1:] &= rng.random(visible[0, 1:].shape) < 0.5  # heads that see differently
        visible[1, 4, 0] = False  # a query that sees nothing: zeros, not NaN
    mask = visible if mask_dtype == TensorProto.BOOL else np.where(visible, 0.0, -1e9).astype(np.float32)
    return {
        "query": rng.standard_normal((BATCH, QUERY_HEADS, NEW, HEAD_DIM), np.float32),
        "key": rng.standard_normal((BATCH, KV_HEADS, NEW, HEAD_DIM), np.float32),
        "value": rng.standard_normal((BATCH, KV_HEADS, NEW, value_dim), np.float32),
        "past_key": rng.standard_normal((BATCH, KV_HEADS, CACHE, HEAD_DIM), np.float32),
        "past_value": rng.standard_normal((BATCH, KV_HEADS, CACHE, value_dim), np.float32),
        "write_indices": write,
        "mask": mask,
    }


@needs_openvino
@pytest.mark.parametrize(
    ("mask_dtype", "scale", "value_dim", "mask_heads"),
    [(TensorProto.FLOAT, 1.0, HEAD_DIM, 1), (TensorProto.BOOL, None, HEAD_DIM, 1),
     (TensorProto.FLOAT, 0.5, 2 * HEAD_DIM, 1), (TensorProto.BOOL, 1.0, HEAD_DIM, QUERY_HEADS)],
    ids=["additive", "boolean-default-scale", "values-wider-than-keys", "a-boolean-mask-per-query-head"],
)  # fmt: skip
def test_a_static_cache_step_runs_on_openvino_as_on_onnxruntime(
    mask_dtype: int, scale: float | None, value_dim: int, mask_heads: int, tmp_path: Path
) -> None:
    """The passes' additive mask with the scale folded; a boolean mask with Attention's default 1/sqrt(head_dim);
    values of another head size than the keys (DeepSeek's decompressed cache); a mask per query head with a
    query that sees no slot."""
    path = cached_step_onnx(tmp_path / "step.onnx", mask_dtype, scale, value_dim, mask_heads)
    feeds = _feeds(mask_dtype, value_dim, mask_heads)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = dict(zip(["y", "present_key", "present_value"], session.run(None, feeds), strict=True))
    with OpenVinoBackend(path, *_specs(onnx.load(str(path))), threads=2, static_cache=True) as backend:
        actual = backend.run(feeds)
    for name in ("present_key", "present_value"):  # every untouched slot as it was, the new rows where they go
        np.testing.assert_array_equal(actual[name], expected[name])
        assert not np.array_equal(actual[name], feeds[name.replace("present", "past")])
    np.testing.assert_allclose(actual["y"], expected["y"], rtol=1e-5, atol=1e-5)


@needs_openvino
def test_tensor_scatter_without_write_indices_writes_from_the_first_slot(tmp_path: Path) -> None:
    model = onnx.load(str(cached_step_onnx(tmp_path / "step.onnx", TensorProto.FLOAT, 1.0)))
    for node in model.graph.node[:2]:
        del node.input[2]
    del model.graph.input[5]  # write_indices
    onnx.save(model, str(tmp_path / "from_zero.onnx"))
    feeds = _feeds(TensorProto.FLOAT)
    del feeds["write_indices"]
    session = onnxruntime.InferenceSession(str(tmp_path / "from_zero.onnx"), providers=["CPUExecutionProvider"])
    with OpenVinoBackend(tmp_path / "from_zero.onnx", *_specs(model), threads=2, static_cache=True) as backend:
        actual = backend.run(feeds)
    np.testing.assert_array_equal(actual["present_key"], session.run(["present_key"], feeds)[0])


@needs_openvino
@pytest.mark.parametrize(("attribute", "value", "named"), [("softcap", 30.0, "softcap"), ("is_causal", 1, "is_causal")])
def test_an_attention_form_the_passes_do_not_write_is_refused_in_one_line_naming_it(
    attribute: str, value: object, named: str, tmp_path: Path
) -> None:
    model = onnx.load(str(cached_step_onnx(tmp_path / "step.onnx", TensorProto.FLOAT, 1.0)))
    model.graph.node[2].attribute.append(helper.make_attribute(attribute, value))
    onnx.save(model, str(tmp_path / "refused.onnx"))
    with pytest.raises(RuntimeLoadError) as caught:
        OpenVinoBackend(tmp_path / "refused.onnx", *_specs(model), threads=2, static_cache=True)
    message = str(caught.value)
    assert f"Attention with {named}: not converted for OpenVINO (use backend='onnxruntime'), node '" in message
    assert "\n" not in message and "Traceback" not in message and ".py(" not in message
