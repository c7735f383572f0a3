"""A vocabulary projection that is the embedding table transposed reads the table through a Transpose
(passes/tied_projection.py): the same outputs on ONNX Runtime, one table in the file and in TensorRT's plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core import ir
from tensorsmith.core.mapped_graph import mapped
from tensorsmith.core.mapped_save import save_mapped
from tensorsmith.passes import run_passes
from tensorsmith.passes.tied_projection import TiedProjection
from tensorsmith.runtime.manifest import external_data_path
from tests.passes.graphs import apply, ops, run_onnx

VOCABULARY, HIDDEN = 512, 64
TABLE = (np.random.default_rng(0).standard_normal((VOCABULARY, HIDDEN)) * 0.1).astype(np.float32)
FEEDS = {"ids": np.array([[3, 7, 11], [5, 1, 500]], np.int64)}


def decoder_ends(head: np.ndarray, dtype: type = np.float32) -> onnx.ModelProto:
    """ids → Gather(TABLE) → Tanh → MatMul(head): a decoder's two ends, the head given (TABLE.T when tied)."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed"),
             helper.make_node("Tanh", ["embedded"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"], name="lm_head")]  # fmt: skip
    element = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        nodes, "ends", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", element, ["b", "s", VOCABULARY])],
        [numpy_helper.from_array(TABLE.astype(dtype), "table"),
         numpy_helper.from_array(np.ascontiguousarray(head).astype(dtype), "head")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_a_tied_head_reads_the_table_transposed_with_the_same_outputs() -> None:
    before = decoder_ends(TABLE.T)
    after, (report,) = apply(before, [TiedProjection()])
    assert report.counts == {"projections_tied": 1} and report.details.as_json()["tied"] == {"head": "table"}
    assert ops(after)["Transpose"] == 1 and [t.name for t in after.graph.initializer] == ["table"]
    np.testing.assert_array_equal(run_onnx(after, FEEDS)[0], run_onnx(before, FEEDS)[0])


def test_a_head_that_differs_in_one_value_is_left_alone() -> None:
    head = TABLE.T.copy()
    head[HIDDEN - 1, VOCABULARY - 1] += 1e-3
    after, (report,) = apply(decoder_ends(head), [TiedProjection()])
    assert report.counts == {"projections_tied": 0} and "Transpose" not in ops(after)
    assert {t.name for t in after.graph.initializer} == {"table", "head"}


def test_mapped_weights_are_compared_in_blocks_and_the_copy_leaves_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    monkeypatch.setattr("tensorsmith.passes.tied_projection.BLOCK_BYTES", 7 * HIDDEN * 4)  # 74 blocks, the last short
    path = tmp_path / "ends.onnx"
    ir.save_onnx(decoder_ends(TABLE.T), path)
    expected, size = run_onnx(onnx.load(str(path)), FEEDS)[0], external_data_path(path).stat().st_size
    with mapped(path) as (graph, _):
        (report,) = run_passes(graph, [TiedProjection()])
        save_mapped(graph, path)
    assert report.counts == {"projections_tied": 1}
    assert external_data_path(path).stat().st_size == size - TABLE.nbytes
    np.testing.assert_array_equal(run_onnx(onnx.load(str(path)), FEEDS)[0], expected)


def test_tensorrt_builds_the_tied_graph_with_one_table(tmp_path: Path) -> None:
    profile = Profile({"ids": ((1, 1), (1, 8), (2, 16))})
    plans = {}
    for name, tied in (("copy", False), ("tied", True)):
        model = decoder_ends(TABLE.T, np.float16)
        if tied:
            model, _ = apply(model, [TiedProjection()])
        onnx.save(model, str(tmp_path / f"{name}.onnx"))
        plans[name] = len(build_engine(tmp_path / f"{name}.onnx", "sm_86", profile).plan)
    assert plans["copy"] - plans["tied"] >= 0.9 * TABLE.nbytes // 2  # the fp16 table's bytes, once less


def test_a_bf16_table_is_tied_too() -> None:
    """onnx-graphsurgeon gives a bf16 weight's dtype as ONNX's type number: compared in blocks all the same."""
    model = decoder_ends(TABLE.T)
    for tensor in model.graph.initializer:  # the same values, stored as bf16 (each fp32 value's upper 16 bits)
        bits = numpy_helper.to_array(tensor).view(np.uint32) >> 16
        tensor.CopyFrom(helper.make_tensor(tensor.name, onnx.TensorProto.BFLOAT16, tensor.dims,
                                           bits.astype(np.uint16).tobytes(), raw=True))  # fmt: skip
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.BFLOAT16
    after, (report,) = apply(model, [TiedProjection()])
    assert report.counts == {"projections_tied": 1} and ops(after)["Transpose"] == 1
