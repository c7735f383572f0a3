"""RMSNorm as exporters write it below opset 23 (transformers' LlamaRMSNorm through the TorchScript exporter; at
opset 23 the dynamo exporter writes RMSNormalization itself), upgraded to opset 23 and fused to RMSNormalization;
LayerNorms are left to their rule."""

from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from tensorsmith.passes import LAYERNORM, RMSNORM, Canonicalize, Fuse
from tests.passes.graphs import apply, assert_same_outputs, ops


class Norms(nn.Module):
    def __init__(self) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        torch.manual_seed(0)
        self.llama = LlamaRMSNorm(16, eps=1e-6)
        self.other = LlamaRMSNorm(16, eps=1e-5)
        self.layer = nn.LayerNorm(16)
        with torch.no_grad():
            self.llama.weight.uniform_(0.5, 1.5)
            self.other.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.other(self.llama(x) * 2.0) + x)


@pytest.mark.parametrize("opset", [17, 20])
def test_rmsnorms_fuse_and_layernorms_do_not(tmp_path: Path, opset: int) -> None:
    x = torch.randn(2, 5, 16) * 3
    path = tmp_path / "norms.onnx"
    torch.onnx.export(Norms().eval(), (x,), str(path), dynamo=False, opset_version=opset, input_names=["x"])
    source = onnx.load(str(path))
    canonical, _ = Canonicalize(opset=23)(source)
    fused, reports = apply(canonical, [Fuse((LAYERNORM, RMSNORM))])
    counted = ops(fused)
    assert counted["RMSNormalization"] == 2 and counted["LayerNormalization"] == 1
    assert counted["Sqrt"] == 0 and counted["ReduceMean"] == 0
    assert reports[0].counts["rmsnorm.matched"] == 2
    assert_same_outputs(source, fused, {"x": x.numpy()})


def test_a_layernorm_alone_is_no_rmsnorm(tmp_path: Path) -> None:
    path = tmp_path / "layernorm.onnx"
    torch.onnx.export(nn.LayerNorm(16).eval(), (torch.randn(2, 16),), str(path), dynamo=False, opset_version=14)
    canonical, _ = Canonicalize(opset=23)(onnx.load(str(path)))
    fused, reports = apply(canonical, [Fuse((RMSNORM,))])
    assert ops(fused)["RMSNormalization"] == 0 and reports[0].counts["rmsnorm.missed"] == 1
