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


def cached_step_onnx(path: Path, mask_dtype: int, scale: float | None) -> Path:
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
    cache = [BATCH, KV_HEADS, CACHE, HEAD_DIM]
    graph = helper.make_graph(
        nodes, "cached_step",
        [_value("query", TensorProto.FLOAT, [BATCH, QUERY_HEADS, NEW, HEAD_DIM]),
         _value("key", TensorProto.FLOAT, [BATCH, KV_HEADS, NEW, HEAD_DIM]),
         _value("value", TensorProto.FLOAT, [BATCH, KV_HEADS, NEW, HEAD_DIM]),
         _value("past_key", TensorProto.FLOAT, cache), _value("past_value", TensorProto.FLOAT, cache),
         _value("write_indices", TensorProto.INT64, [BATCH]),
         _value("mask", mask_dtype, [BATCH, 1, NEW, CACHE])],
        [_value("y", TensorProto.FLOAT, [BATCH, QUERY_HEADS, NEW, HEAD_DIM]),
         _value("present_key", TensorProto.FLOAT, cache), _value("present_value", TensorProto.FLOAT, cache)],
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


def _feeds(mask_dtype: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    write = np.array([2, 9])  # each row's new entries land at its own slots
    visible = np.arange(CACHE)[None, None, :] <= (write[:, None, None] + np.arange(NEW)[None, :, None])  # causal
    visible = visible[:, None]  # [batch, 1, new, cache]
    mask = visible if mask_dtype == TensorProto.BOOL else np.where(visible, 0.0, -1e9).astype(np.float32)
    cache = (BATCH, KV_HEADS, CACHE, HEAD_DIM)
    return {
        "query": rng.standard_normal((BATCH, QUERY_HEADS, NEW, HEAD_DIM), np.float32),
        "key": rng.standard_normal((BATCH, KV_HEADS, NEW, HEAD_DIM), np.float32),
        "value": rng.standard_normal((BATCH, KV_HEADS, NEW, HEAD_DIM), np.float32),
        "past_key": rng.standard_normal(cache, np.float32),
        "past_value": rng.standard_normal(cache, np.float32),
        "write_indices": write,
        "mask": mask,
    }


@needs_openvino
@pytest.mark.parametrize(("mask_dtype", "scale"), [(TensorProto.FLOAT, 1.0), (TensorProto.BOOL, None)])
def test_a_static_cache_step_runs_on_openvino_as_on_onnxruntime(
    mask_dtype: int, scale: float | None, tmp_path: Path
) -> None:
    """Additive mask with the passes' folded scale, and boolean mask with Attention's default 1/sqrt(head_dim)."""
    path = cached_step_onnx(tmp_path / "step.onnx", mask_dtype, scale)
    feeds = _feeds(mask_dtype)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = dict(zip(["y", "present_key", "present_value"], session.run(None, feeds), strict=True))
    with OpenVinoBackend(path, *_specs(onnx.load(str(path))), threads=2) as backend:
        actual = backend.run(feeds)
    for name in ("present_key", "present_value"):  # every untouched slot as it was, the new rows where they go
        np.testing.assert_array_equal(actual[name], expected[name])
        assert not np.array_equal(actual[name], feeds[name.replace("present", "past")])
    np.testing.assert_allclose(actual["y"], expected["y"], rtol=1e-5, atol=1e-5)


@needs_openvino
def test_an_attention_form_the_passes_do_not_write_is_refused_naming_it(tmp_path: Path) -> None:
    model = onnx.load(str(cached_step_onnx(tmp_path / "step.onnx", TensorProto.FLOAT, 1.0)))
    attention = model.graph.node[2]
    attention.attribute.append(helper.make_attribute("softcap", 30.0))
    onnx.save(model, str(tmp_path / "softcap.onnx"))
    with pytest.raises(RuntimeLoadError, match=r"Attention with softcap: not converted for OpenVINO"):
        OpenVinoBackend(tmp_path / "softcap.onnx", *_specs(model), threads=2)
