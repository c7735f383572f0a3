"""An If whose branches hold copies of one weight (a mixture of experts' stacked experts: compiler/frontend/
routed_experts.py) is saved with the weight's bytes once, both branches reading them (core/branch_copies.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as helper
import onnxruntime
import pytest
from onnx import numpy_helper

from tensorsmith.core import ir
from tensorsmith.core.mapped_graph import load_mapped
from tensorsmith.core.mapped_save import save_mapped
from tensorsmith.runtime.manifest import external_data_path

RNG = np.random.default_rng(0)
EXPERTS = RNG.standard_normal((4, 32, 16)).astype(np.float32)  # [experts, out, in]
OTHER = RNG.standard_normal((4, 32, 16)).astype(np.float32)  # the same shape, other values: never shared


def routed_or_every(path: Path) -> Path:
    """If(few): Gather(experts, index) @ x, else: experts @ x + other @ x; each branch with its own initializers,
    as the exporter writes them, saved with its weights outside."""
    x, index = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16, 1]), helper.make_tensor_value_info(
        "index", onnx.TensorProto.INT64, [2])  # fmt: skip
    few = helper.make_tensor_value_info("few", onnx.TensorProto.BOOL, [])
    gathered = helper.make_graph(
        [helper.make_node("Gather", ["experts_then", "index"], ["chosen"]),
         helper.make_node("MatMul", ["chosen", "x"], ["routed"])],
        "gathered", [], [helper.make_tensor_value_info("routed", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(EXPERTS, "experts_then")],
    )  # fmt: skip
    every = helper.make_graph(
        [helper.make_node("MatMul", ["experts_else", "x"], ["own"]), helper.make_node("MatMul", ["other", "x"],
         ["others"]), helper.make_node("Add", ["own", "others"], ["all"])],
        "every", [], [helper.make_tensor_value_info("all", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(EXPERTS, "experts_else"), numpy_helper.from_array(OTHER, "other")],
    )  # fmt: skip
    node = helper.make_node("If", ["few"], ["y"], then_branch=gathered, else_branch=every)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph([node], "g", [few, x, index], [y]), opset_imports=[
        helper.make_opsetid("", 21)])  # fmt: skip
    onnx.save(model, str(path), save_as_external_data=True, location=external_data_path(path).name, size_threshold=0)
    return path


def run(path: Path, few: bool) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"few": np.array(few), "x": np.ones((1, 16, 1), np.float32), "index": np.array([2, 0])}
    return session.run(None, feeds)[0]


def branch_initializers(path: Path) -> dict[str, dict[str, str]]:
    structure = onnx.load(str(path), load_external_data=False)
    found = {}
    for branch in (attribute.g for attribute in structure.graph.node[0].attribute):
        for tensor in branch.initializer:
            found[tensor.name] = {entry.key: entry.value for entry in tensor.external_data}
    return found


@pytest.mark.parametrize("read", [False, True], ids=["mapped", "read-by-a-pass"])
def test_copies_of_a_weight_in_an_if_are_written_once(read: bool, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:  # fmt: skip
    source = routed_or_every(tmp_path / "source.onnx")
    assert external_data_path(source).stat().st_size == 3 * EXPERTS.nbytes  # the export's two copies and OTHER
    graph, _ = load_mapped(source)
    if read:  # a pass that read every weight (as an array, not mapped any more)
        for sub in graph.subgraphs():
            for tensor in sub.tensors().values():
                if hasattr(tensor, "values"):
                    tensor.values = np.array(tensor.values)
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    saved = tmp_path / "saved.onnx"
    save_mapped(graph, saved)
    stored = branch_initializers(saved)
    assert stored["experts_then"]["offset"] == stored["experts_else"]["offset"]
    assert stored["other"]["offset"] != stored["experts_then"]["offset"]
    assert external_data_path(saved).stat().st_size == 2 * EXPERTS.nbytes
    x = np.ones((16, 1), np.float32)
    np.testing.assert_allclose(run(saved, few=True), EXPERTS[[2, 0]] @ x, rtol=1e-5)
    np.testing.assert_allclose(run(saved, few=False), EXPERTS @ x + OTHER @ x, rtol=1e-5)
