"""fp16 variants: every sample converts, runs on ONNX Runtime CPU close to fp32, and builds for Turing; weights and
activations beyond fp16's range keep fp32."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.compiler.variants.fp16_range import ACTIVATION_LIMIT, magnitude, out_of_range_activations
from tensorsmith.core.metrics import mean_cosine
from tensorsmith.core.tensor_ranges import TensorRange, outputs_and_ranges, tensor_ranges
from tensorsmith.passes.fp16 import ConvertToBf16, ConvertToFp16, ConvertToHalf
from tensorsmith.passes.half_float import FP16_FLOAT, FP16_MAX, largest_outside
from tests.conftest import max_relative_error
from tests.passes.graphs import GraphBuilder, apply, ops, run_onnx


class Block(torch.nn.Module):
    """LayerNorm, GELU, an additive mask built from finfo(float32).min (which must not become -inf · 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(16)
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.linear(self.norm(x)) @ x.transpose(-1, -2)
        additive = (1.0 - mask[:, None, :].to(x.dtype)) * torch.finfo(torch.float32).min
        return torch.nn.functional.gelu(torch.softmax(scores + additive, dim=-1) @ x)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    path = tmp_path_factory.mktemp("fp16") / "block.onnx"
    program = torch.onnx.export(
        Block().eval(), (torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.int64)), dynamo=True,
        input_names=["x", "mask"], dynamic_shapes=({0: torch.export.Dim("batch")}, {0: torch.export.Dim("batch")}),
    )  # fmt: skip
    assert program is not None
    program.save(str(path))
    return onnx.load(str(path))


def test_fp16_keeps_layernorm_in_fp32_and_io_in_fp32(exported: onnx.ModelProto, tmp_path: Path) -> None:
    converted, (report,) = apply(exported, [ConvertToFp16()])
    assert report.counts["kept_fp32"] == 1
    graph_types = {value.name: value.type.tensor_type.elem_type for value in converted.graph.input}
    assert graph_types["x"] == onnx.TensorProto.FLOAT
    assert converted.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    weights = [i for i in converted.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16]
    assert weights, "weights are stored in fp16"
    (norm,) = [n for n in converted.graph.node if n.op_type == "LayerNormalization"]
    producers = {output: node for node in converted.graph.node for output in node.output}
    assert producers[norm.input[0]].op_type == "Cast"  # fp16 → fp32 before the LayerNorm
    assert ops(converted)["Cast"] >= 4

    mask = np.ones((3, 5), np.int64)
    mask[1, 3:] = 0
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32), "mask": mask}
    (reference,), (actual,) = run_onnx(exported, feeds), run_onnx(converted, feeds)
    assert np.isfinite(actual).all()
    assert mean_cosine(reference, actual) > 0.9999

    path = tmp_path / "fp16.onnx"
    onnx.save(converted, str(path))
    profile = Profile({"x": ((1, 5, 16), (2, 5, 16), (8, 5, 16)), "mask": ((1, 5), (2, 5), (8, 5))})
    assert len(build_engine(path, "sm_75", profile).plan) > 0  # Turing has no fp32 GEMM: fp16 builds


@pytest.mark.parametrize("convert", [ConvertToFp16, ConvertToBf16])
def test_layernorms_sharing_their_input_and_a_bias_with_other_ops(convert: type[ConvertToHalf]) -> None:
    """Two LayerNorms of one tensor (GPT-NeoX's parallel residual), whose bias is the zeros an Add reads too
    (exporters store equal weights once): one Cast to fp32 serves both, and they read an fp32 bias of their own."""
    g = GraphBuilder(20)
    hidden = g.op("MatMul", "x", g.const(np.random.default_rng(0).standard_normal((16, 16))))
    zeros = g.const(np.zeros(16))
    first = g.op("LayerNormalization", hidden, g.const(np.full(16, 0.5)), zeros, axis=-1)
    second = g.op("LayerNormalization", hidden, g.const(np.full(16, 2.0)), zeros, axis=-1)
    out = g.op("Add", g.op("Add", first, second), zeros)
    model = g.model({"x": (TensorProto.FLOAT, [2, 16])}, {out: TensorProto.FLOAT})
    converted, (report,) = apply(model, [convert()])
    onnx.checker.check_model(converted, full_check=True)  # ordered, each name once, LayerNorm's types agree
    # x and out at the graph's edges, `hidden` widened once, each LayerNorm's output narrowed
    assert report.counts["kept_fp32"] == 2 and report.counts["casts_inserted"] == ops(converted)["Cast"] == 5
    if convert is ConvertToFp16:  # ONNX Runtime's CPU provider has no bf16 MatMul
        feeds = {"x": np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)}
        (reference,), (actual,) = run_onnx(model, feeds), run_onnx(converted, feeds)
        assert mean_cosine(reference, actual) > 0.9999


# fp16 as the pass wrote it before it checked ranges: every weight clipped to ±65504, every activation in fp16
UNCHECKED = replace(FP16_FLOAT, narrower_than_fp32=False)


class Overflows(torch.nn.Module):
    """Three values fp16 cannot hold, one an output: a hidden state of ~1e3 (which fp16 holds) whose RMSNorm squares
    reach ~1.5e6; a weight of 9e4, read by inputs small enough that its products fit; a Linear whose output reaches
    ~8e4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.outlier, self.wide = (torch.nn.Linear(16, 16) for _ in range(3))
        with torch.no_grad():
            self.up.weight.mul_(1e3)
            self.outlier.weight[3, 5] = 9e4
            self.wide.weight.mul_(5e4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.up(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), self.outlier(x * 1e-2), self.wide(x)


def _export(module: torch.nn.Module, path: Path, *example: torch.Tensor) -> onnx.ModelProto:
    program = torch.onnx.export(module.eval(), example, dynamo=True, input_names=["x"])
    assert program is not None
    program.save(str(path))
    return onnx.load(str(path))


def _in_fp16(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The graph's outputs as fp16 arithmetic gives them: onnx's reference evaluator computes each fp16 op in fp16.
    ONNX Runtime's CPU provider cannot show an overflow: it runs the fp16 ops it has no kernel for (Add, Mul,
    Sqrt...) in fp32 and drops the Cast pair around them."""
    return [np.asarray(output, np.float32) for output in ReferenceEvaluator(model).run(None, feeds)]


def test_weights_and_activations_beyond_fp16_keep_fp32(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((3, 4, 16)).astype(np.float32)
    model = _export(Overflows(), tmp_path / "overflows.onnx", torch.from_numpy(x))
    feeds = {"x": x}
    reference = run_onnx(model, feeds)
    names = {node.output[0]: node for node in model.graph.node}

    out_of_range = out_of_range_activations(tmp_path / "overflows.onnx", feeds)
    square = next(name for name in out_of_range if names[name].op_type in ("Pow", "Mul"))
    assert 1e6 < out_of_range[square] < ACTIVATION_LIMIT * 1e3  # the RMSNorm's squares
    assert max(out_of_range.values()) > 65504 and all(value > ACTIVATION_LIMIT for value in out_of_range.values())
    assert not any(names[name].op_type == "Add" and 1e3 < value < 4e3 for name, value in out_of_range.items())

    # Without the range check the squares are inf (so the RMSNorm's output 0), the weight 65504, the output inf
    unchecked, _ = apply(model, [ConvertToHalf(half=UNCHECKED)])
    normalized, clipped, wide = _in_fp16(unchecked, feeds)
    assert max_relative_error(reference[0], normalized) > 0.5 and np.all(normalized == 0)
    assert max_relative_error(reference[1], clipped) > 0.05
    assert np.isinf(wide).any()

    converted, (report,) = apply(model, [ConvertToFp16(out_of_range=out_of_range)])
    onnx.checker.check_model(converted, full_check=True)
    for expected, actual in zip(reference, _in_fp16(converted, feeds), strict=True):
        assert np.isfinite(actual).all() and max_relative_error(expected, actual) < 5e-3
    kept = report.details.as_json()["kept_fp32_for_range"]
    assert isinstance(kept, dict) and report.counts["kept_fp32_for_range"] == len(kept) > 0
    by_reason = {(why["op"], why["reason"]) for why in kept.values()}
    assert {("MatMul", "weight"), ("MatMul", "output"), ("ReduceMean", "input")} <= by_reason, kept
    (weight,) = [why for why in kept.values() if why["reason"] == "weight"]
    assert weight["max_abs"] == 9e4
    # the Linear's output leaves the graph in fp32, from its kept Add, with no round trip through fp16
    producers = {output: node for node in converted.graph.node for output in node.output}
    assert producers[converted.graph.output[2].name].op_type == "Add"
    # ONNX Runtime runs the converted graph too
    for expected, actual in zip(reference, run_onnx(converted, feeds), strict=True):
        assert max_relative_error(expected, actual) < 5e-3


def test_an_embedding_row_beyond_fp16_keeps_its_gather_and_readers_in_fp32() -> None:
    """A table row of 7e4, read through Gather and scaled down: the weight check alone (no activations measured)
    keeps the Gather and, since a Gather only moves the table's values, its reader too."""
    g = GraphBuilder(20)
    table = np.random.default_rng(0).standard_normal((10, 16))
    table[3, 2] = 7e4
    out = g.op("Mul", g.op("Gather", g.const(table), "ids", axis=0), g.const(1e-2))
    model = g.model({"ids": (TensorProto.INT64, [2, 3])}, {out: TensorProto.FLOAT})
    feeds = {"ids": np.array([[3, 1, 4], [1, 5, 9]], np.int64)}
    (expected,) = run_onnx(model, feeds)
    (clipped,) = _in_fp16(apply(model, [ConvertToHalf(half=UNCHECKED)])[0], feeds)
    assert max_relative_error(expected, clipped) > 0.05
    converted, (report,) = apply(model, [ConvertToFp16()])
    (actual,) = _in_fp16(converted, feeds)
    assert max_relative_error(expected, actual) < 1e-3
    kept = report.details.as_json()["kept_fp32_for_range"]
    assert isinstance(kept, dict) and sorted(why["op"] for why in kept.values()) == ["Gather", "Mul"]
    assert {why["reason"] for why in kept.values()} == {"weight"}


def test_a_normal_block_keeps_nothing_in_fp32_for_range(exported: onnx.ModelProto, tmp_path: Path) -> None:
    """The Block's additive mask (finfo(float32).min, scores plus it) stands in for -inf: no range to keep."""
    onnx.save(exported, str(tmp_path / "block.onnx"))
    mask = np.ones((3, 5), np.int64)
    mask[1, 3:] = 0
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32), "mask": mask}
    ranges = tensor_ranges(tmp_path / "block.onnx", feeds)
    outputs, same = outputs_and_ranges(tmp_path / "block.onnx", feeds)  # verification's run measures them too
    assert same == ranges and len(outputs) == len(exported.graph.output)
    for expected, actual in zip(run_onnx(exported, feeds), outputs, strict=True):
        np.testing.assert_array_equal(actual, expected)
    assert min(tensor.low for tensor in ranges) < -1e38  # the mask is measured, and left out
    assert out_of_range_activations(tmp_path / "block.onnx", feeds) == {}
    _, (report,) = apply(exported, [ConvertToFp16(out_of_range={})])
    assert report.counts["kept_fp32_for_range"] == 0 and report.details.as_json() == {}
    assert report.counts["kept_fp32"] == 1  # the LayerNorm
    assert ConvertToBf16()(gs.import_onnx(exported)).counts.keys() == {"constants_converted", "casts_inserted",
                                                                         "kept_fp32"}  # fmt: skip


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, -65504.0, 65504.0], 0.0),  # within the range
        ([1.0, 7e4, -9e4], 9e4),
        ([np.finfo(np.float32).min, -1e9, np.inf, -np.inf, np.nan, 2.0], 0.0),  # stand-ins for infinity
        ([np.finfo(np.float32).min, 1e5], 1e5),
        ([], 0.0),
    ],
)
def test_largest_outside(values: list[float], expected: float) -> None:
    assert largest_outside(np.array(values, np.float32), FP16_MAX) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (-3.0, 2.0, 3.0),
        (-np.finfo(np.float32).max, 5e4, 5e4),  # scores plus finfo(float32).min: a mask, not a range
        (-1e9, 10.0, 10.0),
        (-9e8, 10.0, 9e8),  # a real negative range
        (np.inf, -np.inf, 0.0),  # an empty tensor's reduction
        (-np.inf, np.nan, 0.0),
    ],
)
def test_tensor_range_magnitude(low: float, high: float, expected: float) -> None:
    assert magnitude(TensorRange("t", low, high)) == pytest.approx(expected)
