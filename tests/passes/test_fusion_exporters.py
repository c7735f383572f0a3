"""Fusions on what real exporters emit: TorchScript at opsets 14 and 17, dynamo at 18 and 20."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from tensorsmith.passes import Canonicalize, default_passes
from tests.passes.graphs import apply, assert_same_outputs, ops

DECOMPOSED = ("ReduceMean", "Erf", "Tanh", "Pow", "Sqrt")


class Block(nn.Module):
    """LayerNorm with and without affine parameters, exact and tanh GELU, and a scaled attention score."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.query = nn.Linear(16, 16)
        self.key = nn.Linear(16, 16)
        self.plain_norm = nn.LayerNorm(16, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = self.down(nn.functional.gelu(self.up(h)))
        h = nn.functional.gelu(h, approximate="tanh")
        scores = torch.softmax(self.query(h) @ self.key(h).transpose(-1, -2) / 4.0, dim=-1)
        return self.plain_norm(scores @ h + x)


EXPORTS = [("torchscript", 14), ("torchscript", 17), ("dynamo", 18), ("dynamo", 20)]


def export(path: Path, exporter: str, opset: int) -> onnx.ModelProto:
    x = torch.randn(2, 5, 16)
    axes = {"x": {0: "batch", 1: "sequence"}}
    if exporter == "dynamo":
        batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
        program = torch.onnx.export(
            Block().eval(), (x,), dynamo=True, opset_version=opset, input_names=["x"],
            dynamic_shapes=({0: batch, 1: sequence},),
        )  # fmt: skip
        assert program is not None
        program.save(str(path))
    else:
        torch.onnx.export(
            Block().eval(), (x,), str(path), dynamo=False, opset_version=opset, input_names=["x"], dynamic_axes=axes
        )
    return onnx.load(str(path))


@pytest.mark.parametrize(("exporter", "opset"), EXPORTS)
def test_exported_block_fuses_fully(exporter: str, opset: int, tmp_path: Path) -> None:
    exported = export(tmp_path / "block.onnx", exporter, opset)
    canonical, _ = Canonicalize(opset=20)(exported)
    fused, reports = apply(canonical, default_passes())

    counts = ops(fused)
    assert counts["LayerNormalization"] == 2, counts
    assert counts["Gelu"] == 2, counts
    approximations = sorted(
        attribute.s for node in fused.graph.node if node.op_type == "Gelu" for attribute in node.attribute
    )
    assert approximations in ([b"tanh"], [b"none", b"tanh"]), approximations  # "none" is Gelu's default
    assert not {op: counts[op] for op in DECOMPOSED if counts[op]}
    assert all(node.domain in ("", "ai.onnx") for node in fused.graph.node), "standard ops only"
    scale = next(report for report in reports if report.name == "fold_attention_scale")
    assert scale.counts["attention_scale.matched"] == 1, scale.details
    x = np.random.default_rng(1).standard_normal((3, 7, 16)).astype(np.float32)
    assert_same_outputs(exported, fused, {"x": x}, tolerance=1e-5)
