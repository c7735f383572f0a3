"""fp16 variants: every sample converts, runs on ONNX Runtime CPU close to fp32, and builds for Turing."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core.metrics import mean_cosine
from tensorsmith.passes.fp16 import ConvertToBf16, ConvertToFp16, ConvertToHalf
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
