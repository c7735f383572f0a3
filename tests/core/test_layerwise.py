"""A saved graph run a layer at a time (core/layerwise.py): the same outputs as one session over the whole graph,
and a peak that does not grow with the number of layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorsmith.core.graph_segments import segments
from tensorsmith.core.ir import save_onnx
from tensorsmith.core.layerwise import LayerwiseSession, layerwise, layerwise_segments
from tensorsmith.core.module_paths import MODULE_KEY
from tensorsmith.core.sessions import open_session, session_with_outputs
from tensorsmith.core.tensor_ranges import outputs_and_ranges


def _layers(path: Path, layers: int, hidden: int = 64, inner: int = 256, named: bool = True) -> Path:
    """A residual MLP stack of `layers` numbered modules, the shape of a decoder's layers (and a shared value, the
    scale every layer reads, made before the first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "two"], ["scale"], name="scale")]
    weights = [numpy_helper.from_array(np.array(0.5, np.float32), "two")]
    current = "x"
    for index in range(layers):
        up, down = f"layers.{index}.up", f"layers.{index}.down"
        for name, shape in ((up, (hidden, inner)), (down, (inner, hidden))):
            weights.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.05, name))
        made = [
            helper.make_node("MatMul", [current, up], [f"{index}/h"], name=f"{index}/up"),
            helper.make_node("Relu", [f"{index}/h"], [f"{index}/r"], name=f"{index}/relu"),
            helper.make_node("MatMul", [f"{index}/r", down], [f"{index}/d"], name=f"{index}/down"),
            helper.make_node("Mul", [f"{index}/d", "scale"], [f"{index}/s"], name=f"{index}/scaled"),
            helper.make_node("Add", [current, f"{index}/s"], [f"{index}/out"], name=f"{index}/residual"),
        ]
        for node in made if named else []:
            node.metadata_props.add(key=MODULE_KEY, value=f"model.layers.{index}.mlp")
        nodes += made
        current = f"{index}/out"
    nodes.append(helper.make_node("Identity", [current], ["y"], name="head"))
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", hidden]) for name in ("x", "y")]
    graph = helper.make_graph(nodes, "stack", values[:1], values[1:], weights)
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _feeds(hidden: int = 64) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((3, hidden)).astype(np.float32)}


def test_a_layerwise_run_gives_the_whole_graph_s_outputs(tmp_path: Path) -> None:
    path = _layers(tmp_path / "model.onnx", layers=6, hidden=256, inner=1024)
    structure = onnx.load(str(path), load_external_data=False)
    cut = segments(structure, 0)
    assert len(cut) == 6  # one a layer: the shared scale goes with the first, the head with the last
    assert cut[1].inputs == ["0/out", "scale"] and cut[1].outputs == ["1/out"]
    assert len(segments(structure, 2 * cut[1].weight_bytes)) == 3  # two layers a segment
    whole = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, _feeds(256))
    with layerwise("always"):
        session = open_session(path)
        assert isinstance(session, LayerwiseSession)
        assert [value.name for value in session.get_inputs()] == ["x"]
        assert session.get_outputs()[0].shape == ["rows", 256]
        np.testing.assert_allclose(session.run(None, _feeds(256))[0], whole[0], rtol=1e-5, atol=1e-6)
        observed = session_with_outputs(path, ["2/h"])  # an observer's tensors inside the graph
        _, inner = observed.run(None, _feeds(256))
        assert inner.shape == (3, 1024)
        outputs, ranges = outputs_and_ranges(path, _feeds(256))
    expected_outputs, expected_ranges = outputs_and_ranges(path, _feeds(256))
    np.testing.assert_allclose(outputs[0], expected_outputs[0], rtol=1e-5, atol=1e-6)
    assert [r.name for r in ranges] == [r.name for r in expected_ranges]
    assert np.allclose([r.high for r in ranges], [r.high for r in expected_ranges], rtol=1e-5)


def test_a_pass_over_many_batches_reads_each_segment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An observer's pass (AWQ's statistics) over several batches: the values of one run a batch, each segment's
    session opened once for all of them, and every value handed over in batch order."""
    path = _layers(tmp_path / "model.onnx", layers=4, hidden=64, inner=256)
    batches = [{"x": np.random.default_rng(seed).standard_normal((3, 64)).astype(np.float32)} for seed in range(5)]
    observed = ["0/h", "2/r", "3/out"]  # inside segments, and a value a later segment reads too
    with layerwise("always"):
        session = session_with_outputs(path, observed)
        assert isinstance(session, LayerwiseSession)
        opened = []
        real_open = session._open
        monkeypatch.setattr(
            session, "_open", lambda segment, **how: opened.append(segment) or real_open(segment, **how)
        )
        got: list[tuple[int, str, np.ndarray]] = []
        session.run_each(observed, batches, lambda number, name, value: got.append((number, name, value)))
        assert len(opened) == len(session.segments) == 4
        expected = [dict(zip(observed, session.run(observed, batch), strict=True)) for batch in batches]
    assert sorted((number, name) for number, name, _ in got) == [
        (n, name) for n in range(5) for name in sorted(observed)
    ]
    for name in observed:  # in batch order for any one name
        assert [number for number, seen, _ in got if seen == name] == list(range(5))
    for number, name, value in got:
        np.testing.assert_array_equal(value, expected[number][name])
        # its own bytes: a view into a segment session's arena, kept for a later segment, would keep the arena
        # (at Llama-3.1-8B's shape the pass grew from 8.2 to 12.6 GB in 14 minutes)
        assert value.flags.owndata


def test_a_pass_computes_only_what_it_observes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Observing layer 1's values: the segments after it are never opened, and layer 1's own segment is narrowed
    to what those values need (its down projection's weight not read), as the logits after the last observed layer
    of a decoder are not computed."""
    path = _layers(tmp_path / "model.onnx", layers=4, hidden=64, inner=256)
    batches = [{"x": np.random.default_rng(seed).standard_normal((3, 64)).astype(np.float32)} for seed in range(3)]
    with layerwise("always"):
        session = session_with_outputs(path, ["1/r"])
        assert isinstance(session, LayerwiseSession)
        expected = [session.run(["1/r"], batch)[0] for batch in batches]
        opened: list = []
        real_open = session._open
        monkeypatch.setattr(
            session, "_open", lambda segment, **how: opened.append(segment) or real_open(segment, **how)
        )
        got: list[tuple[int, str, np.ndarray]] = []
        session.run_each(["1/r"], batches, lambda number, name, value: got.append((number, name, value)))
    assert len(opened) == 2 and opened[-1].outputs == ["1/r"]
    assert [tensor.name for tensor in opened[-1].initializers] == ["layers.1.up"]
    for number, _, value in got:
        np.testing.assert_array_equal(value, expected[number])


def test_a_segment_run_once_opens_without_graph_optimizations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run opens each segment for one run: without ONNX Runtime's graph optimizations and memory arena (folding and
    prepacking every weight cost more than running it once); a pass over many batches opens them with the caller's
    options. The outputs are the same either way."""
    path = _layers(tmp_path / "model.onnx", layers=3, hidden=64, inner=256)
    batches = [{"x": np.random.default_rng(seed).standard_normal((3, 64)).astype(np.float32)} for seed in range(2)]
    real = onnxruntime.InferenceSession
    levels: list[tuple[object, bool]] = []

    def recorded(path: str, options: onnxruntime.SessionOptions | None = None, **how: object) -> object:
        levels.append((options.graph_optimization_level, options.enable_cpu_mem_arena) if options else (None, True))
        return real(path, options, **how)

    with layerwise("always"):
        session = open_session(path)
        assert isinstance(session, LayerwiseSession)
        monkeypatch.setattr(onnxruntime, "InferenceSession", recorded)
        once = [session.run(["y"], batch)[0] for batch in batches]
        assert set(levels) == {(onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL, False)} and len(levels) == 6
        levels.clear()
        many: list[np.ndarray] = []
        session.run_each(["y"], batches, lambda _, __, value: many.append(value))
    assert len(levels) == 3 and all(level != onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL for level, _ in levels)
    for ran_once, ran_with_others in zip(once, many, strict=True):
        np.testing.assert_allclose(ran_once, ran_with_others, rtol=1e-6, atol=1e-6)
    # a quantized variant's segment is measured as it ships: ONNX Runtime's optimizers make its kernels
    # (DequantizeLinear -> MatMul becomes MatMulNBits at the variant's accuracy level)
    codes = numpy_helper.from_array(np.ones((64, 64), np.int8), "codes")
    scale = numpy_helper.from_array(np.array(0.01, np.float32), "scale")
    nodes = [
        helper.make_node("DequantizeLinear", ["codes", "scale"], ["w"]),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", 64]) for name in ("x", "y")]
    graph = helper.make_graph(nodes, "quantized", values[:1], values[1:], [codes, scale])
    quantized = tmp_path / "quantized.onnx"
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), quantized)
    levels.clear()
    with layerwise("always"):
        open_session(quantized).run(["y"], _feeds(64))
    assert levels and all(level != onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL for level, _ in levels)


def test_a_graph_without_module_paths_is_cut_by_weight(tmp_path: Path) -> None:
    path = _layers(tmp_path / "model.onnx", layers=32, hidden=128, inner=512, named=False)
    cut = segments(onnx.load(str(path), load_external_data=False), 0)
    assert 8 <= len(cut) <= 17  # about UNNAMED_SEGMENTS of equal weight
    whole = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, _feeds(128))
    run = LayerwiseSession(path, 0).run(["y"], _feeds(128))
    np.testing.assert_allclose(run[0], whole[0], rtol=1e-5, atol=1e-6)


def test_auto_runs_a_graph_layerwise_only_when_its_weights_are_large(tmp_path: Path) -> None:
    path = _layers(tmp_path / "model.onnx", layers=2)
    assert layerwise_segments(path) is None  # 0.1 MB: held whole
    with layerwise("always"):
        assert layerwise_segments(path) == 0
    with layerwise("never"):
        assert layerwise_segments(path) is None


PEAK = """
import sys
from pathlib import Path
import numpy as np
from tensorsmith.core.layerwise import layerwise
from tensorsmith.core.sessions import run_onnx

with layerwise(sys.argv[2]):
    run_onnx(Path(sys.argv[1]), {"x": np.ones((4, 1024), np.float32)})
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _peak(path: Path, mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PEAK, str(path), mode], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_a_layerwise_run_s_peak_does_not_grow_with_the_layers(tmp_path: Path) -> None:
    """The bound itself, each run in its own process: 16 layers of 32 MB peak less than one layer + 48 MB above 4
    layers run the same way; held whole, the same graphs differ by their 384 MB of weights."""
    small = _layers(tmp_path / "4" / "model.onnx", layers=4, hidden=1024, inner=4096)
    large = _layers(tmp_path / "16" / "model.onnx", layers=16, hidden=1024, inner=4096)
    layer = 2 * 1024 * 4096 * 4
    assert _peak(large, "always") - _peak(small, "always") < layer + (48 << 20)
    assert _peak(large, "never") - _peak(small, "never") > 8 * layer  # what the bound guards against
