"""A graph run a few rows at a time (core/sessions.run_in_rows, compiler/variants/measure.py): the same outputs and
figures as one run of every row, and a whole run where an output is not by row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as helper
import pytest

from tensorsmith.core import sessions

RNG = np.random.default_rng(0)
X = RNG.standard_normal((7, 5)).astype(np.float32)


def saved(path: Path, node: onnx.NodeProto, output_shape: list[int | str]) -> Path:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", 5])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, output_shape)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, path)
    return path


def test_rows_joined_are_one_run_of_every_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = saved(tmp_path / "tanh.onnx", helper.make_node("Tanh", ["x"], ["y"]), ["rows", 5])
    monkeypatch.setattr(sessions, "RUN_BYTES", 2 * 5 * 4)  # two rows a run, after the first row alone
    runs = [rows for rows, _ in sessions.run_in_rows(sessions.open_session(path), {"x": X})]
    assert runs == [slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 7)]
    whole = sessions.run_onnx(path, {"x": X})[0]
    np.testing.assert_array_equal(sessions.run_onnx(path, {"x": X}, in_rows=True)[0], whole)


def test_an_output_not_by_row_runs_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", 5])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [5])],
                              [onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")])  # fmt: skip
    path = tmp_path / "sum.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    monkeypatch.setattr(sessions, "RUN_BYTES", 1)
    with pytest.raises(sessions.NotByRow):
        list(sessions.run_in_rows(sessions.open_session(path), {"x": X}))
    np.testing.assert_allclose(sessions.run_onnx(path, {"x": X}, in_rows=True)[0], X.sum(0), rtol=1e-6)


def test_a_variant_measured_in_rows_has_the_whole_runs_figures(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:  # fmt: skip
    from tensorsmith.compiler.variants.measure import Evaluation, measure_variant, whole_figures

    path = saved(tmp_path / "tanh.onnx", helper.make_node("Tanh", ["x"], ["y"]), ["rows", 5])
    evaluation = Evaluation({"x": X}, [np.tanh(X) + 0.01 * RNG.standard_normal(X.shape)], None, "seven rows")
    monkeypatch.setattr(sessions, "RUN_BYTES", 2 * 5 * 4)
    measured = measure_variant(path, evaluation)
    assert measured == pytest.approx(whole_figures(evaluation, sessions.run_onnx(path, {"x": X})), rel=1e-12)
    assert measured["cosine"] < 1.0


def test_a_fixed_batch_runs_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [7, 5])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [7, 5])
    graph = helper.make_graph([helper.make_node("Tanh", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "fixed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    monkeypatch.setattr(sessions, "RUN_BYTES", 1)
    with pytest.raises(sessions.NotByRow):
        list(sessions.run_in_rows(sessions.open_session(path), {"x": X}))
    np.testing.assert_array_equal(
        sessions.run_onnx(path, {"x": X}, in_rows=True)[0], sessions.run_onnx(path, {"x": X})[0]
    )


def test_outputs_kept_own_their_bytes_not_the_sessions_arena(tmp_path: Path) -> None:
    """ONNX Runtime's output arrays are views into its arena; run_onnx's own their bytes, so that holding them does
    not hold the arena (at the 1B shape, 9 MB of outputs kept 1.2 GB)."""
    path = saved(tmp_path / "tanh.onnx", helper.make_node("Tanh", ["x"], ["y"]), ["rows", 5])
    session = sessions.open_session(path)
    assert session.run(None, {"x": X})[0].base is not None  # what ONNX Runtime returns: a view
    (kept,) = sessions.run_onnx(path, {"x": X})
    assert kept.base is None and kept.flags.owndata
    np.testing.assert_allclose(kept, np.tanh(X), rtol=1e-5, atol=1e-6)
