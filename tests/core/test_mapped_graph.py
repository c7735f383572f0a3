"""Graphs whose weights stay in their file (core/mapped_graph.py): read only when a pass needs them, written once,
rewritable in place, packed 4-bit tensors copied as stored; sessions over a saved graph with extra outputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as helper
import onnx_graphsurgeon as gs
import onnxruntime
import pytest
from onnx import numpy_helper

from tensorsmith.core import ir, mapped_graph
from tensorsmith.core.mapped_graph import ConvertedValues, MappedValues, convert_values, load_mapped
from tensorsmith.core.mapped_save import save_mapped
from tensorsmith.core.sessions import session_with_outputs
from tensorsmith.passes import PassReport
from tensorsmith.passes.int4 import int4_constant
from tensorsmith.runtime.manifest import external_data_path

RNG = np.random.default_rng(0)
FIRST, SECOND = RNG.standard_normal((64, 32)).astype(np.float32), RNG.standard_normal((32, 16)).astype(np.float32)
BIAS = RNG.standard_normal(16).astype(np.float32)  # 64 bytes: stays inside the protobuf
FEEDS = {"x": RNG.standard_normal((2, 64)).astype(np.float32)}


def two_matmuls(path: Path) -> Path:
    """x @ FIRST → hidden → @ SECOND + BIAS, saved with its weights outside it."""
    nodes = [helper.make_node("MatMul", ["x", "first"], ["hidden"]), helper.make_node("MatMul", ["hidden", "second"],
             ["product"]), helper.make_node("Add", ["product", "bias"], ["y"])]  # fmt: skip
    weights = [numpy_helper.from_array(FIRST, "first"), numpy_helper.from_array(SECOND, "second"),
               numpy_helper.from_array(BIAS, "bias")]  # fmt: skip
    x, y = (helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2, width]) for name, width in (("x", 64),
            ("y", 16)))  # fmt: skip
    graph = helper.make_graph(nodes, "g", [x], [y], weights)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
        ir.save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    assert external_data_path(path).is_file()
    return path


def outputs(path: Path) -> np.ndarray:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]


def test_weights_are_mapped_until_read_and_rewritten_in_place(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = two_matmuls(tmp_path / "model.onnx")
    expected = outputs(path)
    graph, _ = load_mapped(path)
    constants = {name: tensor for name, tensor in graph.tensors().items() if name in ("first", "second")}
    assert all(isinstance(tensor._values, MappedValues) for tensor in constants.values())
    constants["second"].values = constants["second"].values * 2  # a pass's edit: copy-on-write, not the file's
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    save_mapped(graph, path)  # the file it reads from
    assert not list(tmp_path.glob(".*partial"))
    np.testing.assert_allclose(outputs(path), 2 * (expected - BIAS) + BIAS, rtol=1e-5, atol=1e-5)
    assert isinstance(constants["first"]._values, MappedValues)  # the graph reads the new file afterwards
    np.testing.assert_array_equal(constants["first"]._values.load(), FIRST)
    np.testing.assert_array_equal(np.asarray(constants["second"]._values.load()), SECOND * 2)


@pytest.mark.parametrize(("edit", "dead_at_most", "expected"), [
    ("scaled", 0.0, "into its own unread bytes"),  # a new array of the old one's size
    ("reversed", 1.0, "appended"),  # a view of the mapped weight: its bytes are still read while it is written
    ("reversed", 0.0, "rewritten whole"),  # appending would leave its old bytes unread
])  # fmt: skip
def test_a_graph_saved_over_its_file_keeps_the_weights_no_pass_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, edit: str, dead_at_most: float, expected: str
) -> None:
    path = two_matmuls(tmp_path / "model.onnx")
    sidecar = external_data_path(path)
    size, inode = sidecar.stat().st_size, sidecar.stat().st_ino
    graph, _ = load_mapped(path)
    first, second = graph.tensors()["first"], graph.tensors()["second"]
    offset = first._values.offset
    second.values = second.values * 2 if edit == "scaled" else second.values[:, ::-1]
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    monkeypatch.setattr(ir, "DEAD_AT_MOST", dead_at_most)
    save_mapped(graph, path)
    edited = SECOND * 2 if edit == "scaled" else SECOND[:, ::-1]
    np.testing.assert_allclose(outputs(path), FEEDS["x"] @ FIRST @ edited + BIAS, rtol=1e-5, atol=1e-5)
    after = (sidecar.stat().st_ino == inode, sidecar.stat().st_size - size)
    assert after == {"into its own unread bytes": (True, 0), "appended": (True, SECOND.nbytes),
                     "rewritten whole": (False, 0)}[expected]  # fmt: skip
    assert first._values.offset == offset or expected == "rewritten whole"
    np.testing.assert_array_equal(first._values.load(), FIRST)
    assert not list(tmp_path.glob(".*partial"))


def test_a_graph_saved_elsewhere_with_no_new_weight_shares_the_file_and_never_writes_into_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The static cache's rewriting of a variant adds nodes, not weights: the new graph links the variant's
    weights file. Edited and saved over later, it breaks the link rather than write into the other graph's file."""
    path = two_matmuls(tmp_path / "model.onnx")
    sidecar = external_data_path(path)
    stored = sidecar.read_bytes()
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    graph, _ = load_mapped(path)
    graph.outputs[0].name = "y"  # a structural edit only
    other = tmp_path / "early" / "model.onnx"
    save_mapped(graph, other)
    assert external_data_path(other).stat().st_ino == sidecar.stat().st_ino  # linked, not written
    np.testing.assert_allclose(outputs(other), outputs(path), rtol=0, atol=0)

    graph, _ = load_mapped(other)
    graph.tensors()["second"].values = graph.tensors()["second"].values * 2  # a new array of the old one's size
    save_mapped(graph, other)
    assert external_data_path(other).stat().st_ino != sidecar.stat().st_ino and sidecar.read_bytes() == stored
    np.testing.assert_allclose(outputs(other), FEEDS["x"] @ FIRST @ (SECOND * 2) + BIAS, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs(path), FEEDS["x"] @ FIRST @ SECOND + BIAS, rtol=1e-5, atol=1e-5)


def test_a_small_graph_is_written_with_its_weights_inside(tmp_path: Path) -> None:
    source = two_matmuls(tmp_path / "model.onnx")
    graph, _ = load_mapped(source)
    save_mapped(graph, tmp_path / "inline.onnx")  # 8 KB, far below EXTERNAL_DATA_ABOVE
    assert not external_data_path(tmp_path / "inline.onnx").exists()
    np.testing.assert_allclose(outputs(tmp_path / "inline.onnx"), outputs(source), rtol=1e-6)


def test_packed_int4_weights_are_written_and_read_back_as_stored(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:  # fmt: skip
    path = two_matmuls(tmp_path / "model.onnx")
    graph, _ = load_mapped(path)
    codes = RNG.integers(-8, 8, (64, 32)).astype(np.int8)
    matmul = next(node for node in graph.nodes if node.inputs[1].name == "first")
    matmul.inputs[1] = int4_constant("first_int4", codes)  # not run: the bytes are the point
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    save_mapped(graph, tmp_path / "int4.onnx")
    tensor = next(t for t in onnx.load(str(tmp_path / "int4.onnx"), load_external_data=False).graph.initializer
                  if t.name == "first_int4")  # fmt: skip
    assert tensor.data_type == onnx.TensorProto.INT4
    assert {e.key: e.value for e in tensor.external_data}["length"] == str(codes.size // 2)  # two a byte
    again, _ = load_mapped(tmp_path / "int4.onnx")
    np.testing.assert_array_equal(np.asarray(again.tensors()["first_int4"].values, dtype=np.int8), codes)
    save_mapped(again, tmp_path / "copy.onnx")  # a mapped packed tensor copied as its bytes
    assert external_data_path(tmp_path / "copy.onnx").stat().st_size == external_data_path(
        tmp_path / "int4.onnx").stat().st_size  # fmt: skip


def test_a_session_over_a_saved_graph_returns_inner_tensors_and_leaves_no_file(tmp_path: Path) -> None:
    path = two_matmuls(tmp_path / "model.onnx")
    before = sorted(tmp_path.iterdir())
    session = session_with_outputs(path, ["hidden"])
    hidden, y = session.run(["hidden", "y"], FEEDS)
    np.testing.assert_allclose(hidden, FEEDS["x"] @ FIRST, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, outputs(path), rtol=1e-6)
    assert sorted(tmp_path.iterdir()) == before


def test_a_session_over_a_graph_is_found_by_its_path_while_it_is_held(tmp_path: Path) -> None:
    """The decoder feeds' prefill borrows an observer's session rather than opening a second fp32 one."""
    import gc

    from tensorsmith.core.sessions import session_over

    path = two_matmuls(tmp_path / "model.onnx")
    assert session_over(path) is None
    session = session_with_outputs(path, ["hidden"])
    assert session_over(tmp_path / "." / "model.onnx") is session
    del session
    gc.collect()
    assert session_over(path) is None


def test_an_observer_takes_the_run_its_feeds_made_on_the_borrowed_session(tmp_path: Path) -> None:
    """A decoder's calibration feeds run each prefill on the observer's session for its cache; the observer then
    takes that run (equal feeds, re-wrapped by batching) instead of running the graph a second time."""
    from tensorsmith.calibration import Observer
    from tensorsmith.core.sessions import run_remembered, session_over

    path = two_matmuls(tmp_path / "model.onnx")
    observer = Observer(path, ["hidden"], providers=["CPUExecutionProvider"])
    borrowed = session_over(path)
    remembered = run_remembered(borrowed, FEEDS)
    assert set(remembered) == {"y", "hidden"}
    rewrapped = {"x": FEEDS["x"][0:2]}  # what CalibrationData.batches yields: a new dict, a view
    assert observer.run(rewrapped)["hidden"] is remembered["hidden"]
    again = observer.run(rewrapped)  # forgotten once taken: this one runs
    assert again["hidden"] is not remembered["hidden"]
    np.testing.assert_array_equal(again["hidden"], remembered["hidden"])
    run_remembered(borrowed, FEEDS)
    other = {"x": FEEDS["x"] + 1.0}  # other values: never the remembered run
    np.testing.assert_allclose(observer.run(other)["hidden"], other["x"] @ FIRST, rtol=1e-5, atol=1e-5)


def test_a_rewrite_lets_go_of_every_weight_it_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """onnx-graphsurgeon's tensors refer to themselves, so a graph let go keeps the weights its passes read (their
    mapped pages resident) until Python's cycle collector runs: a rewrite lets them go itself, the weight a pass
    replaced included (the INT4 rewrite at the 1B shape kept 6 GB so)."""
    import gc
    import weakref

    from tensorsmith.compiler.variants.rewrite import rewrite_file

    path = two_matmuls(tmp_path / "model.onnx")
    read: list[weakref.ref[np.ndarray]] = []
    load = MappedValues.load

    def recorded(self: MappedValues) -> np.ndarray:
        values = load(self)
        read.append(weakref.ref(values))
        return values

    @dataclass
    class DoubleTheFirst:  # replaces a weight, as INT4's pass does, and reads another
        name: str = "double_the_first"

        def __call__(self, graph: gs.Graph) -> PassReport:
            node = next(node for node in graph.nodes if node.inputs[1].name == "first")
            node.inputs[1] = gs.Constant("first_doubled", node.inputs[1].values * 2)
            assert next(node for node in graph.nodes if node.inputs[1].name == "second").inputs[1].values.size
            return PassReport(self.name, changed=True)

    monkeypatch.setattr(MappedValues, "load", recorded)
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    gc.disable()
    try:
        rewrite_file(path, [DoubleTheFirst()], tmp_path / "rewritten.onnx")
        assert len(read) == 2 and all(reference() is None for reference in read)
    finally:
        gc.enable()
    np.testing.assert_allclose(outputs(tmp_path / "rewritten.onnx"), FEEDS["x"] @ (2 * FIRST) @ SECOND + BIAS,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_a_pass_reads_a_mapped_weight_without_keeping_it(tmp_path: Path) -> None:
    """passes.matching.constant_value maps a weight for its caller and leaves the graph's constant unread: a pass
    that reads every weight (INT4's) would otherwise hold all of them until the rewrite ends."""
    from tensorsmith.passes.matching import constant_value

    graph, _ = load_mapped(two_matmuls(tmp_path / "model.onnx"))
    first = graph.tensors()["first"]
    np.testing.assert_array_equal(constant_value(first), FIRST)
    assert isinstance(first._values, MappedValues)


def test_a_converted_weight_is_converted_as_it_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """fp16's conversion of mapped weights (ConvertedValues): nothing converted until the save, which writes each
    weight a block of rows at a time, in place of the file it reads; the values are numpy's conversion."""
    path = two_matmuls(tmp_path / "model.onnx")
    graph, _ = load_mapped(path)
    constants = {name: tensor for name, tensor in graph.tensors().items() if name in ("first", "second", "bias")}
    converted = []
    for constant in constants.values():
        convert_values(constant, lambda values: converted.append(values.shape) or values.astype(np.float16),
                       np.float16)  # fmt: skip
    assert not converted and all(isinstance(constant._values, ConvertedValues) for constant in constants.values())
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)
    monkeypatch.setattr(mapped_graph, "WRITE_BLOCK", 24 * 16 * 2)  # 24 rows of SECOND's 16 halves
    save_mapped(graph, path)
    # SECOND in two blocks of rows, read from its file; the bias (32 bytes: inside the protobuf) whole
    assert (24, 16) in converted and (8, 16) in converted and (16,) in converted
    saved = onnx.load(str(path))
    weights = {tensor.name: numpy_helper.to_array(tensor) for tensor in saved.graph.initializer}
    for name, original in (("first", FIRST), ("second", SECOND), ("bias", BIAS)):
        assert weights[name].dtype == np.float16
        np.testing.assert_array_equal(weights[name], original.astype(np.float16))
