"""The frontend stage on its own: opening a source, then the fused graph of a real export, saved and verified."""

from pathlib import Path

import onnx
import torch

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.fused import MODEL_NAME, fused_graph
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.core.progress import LogReporter
from tests.conftest import small_mlp_onnx


class LayerNormMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8)
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(self.norm(x)))


def build_layernorm_mlp() -> LayerNormMLP:
    return LayerNormMLP()


def test_an_onnx_source_is_opened_once_with_its_own_inputs_declared(tmp_path: Path) -> None:
    path = small_mlp_onnx(tmp_path / "mlp.onnx")
    source = open_source(CompileConfig.create({"source": str(path)}))
    assert [decl.describe() for decl in source.config.inputs] == ["x:float32:2,8"]
    assert isinstance(source.onnx_model, onnx.ModelProto)


def test_declared_dims_are_applied_to_the_loaded_onnx_source(tmp_path: Path) -> None:
    path = small_mlp_onnx(tmp_path / "mlp.onnx")
    config = CompileConfig.create({"source": str(path), "inputs": [{"name": "x", "dtype": "float32",
                                                                    "dims": ["batch", 8]}]})  # fmt: skip
    source = open_source(config)
    assert source.config.inputs == config.inputs and source.default_dims == ["batch"]
    assert source.onnx_model is not None
    assert source.onnx_model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_a_pytorch_source_is_not_exported_before_its_stage() -> None:
    config = CompileConfig.create({"source": f"{__name__}:build_layernorm_mlp",
                                   "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}]})  # fmt: skip
    assert open_source(config).onnx_model is None


def test_the_fused_graph_is_saved_fused_and_verified(tmp_path: Path) -> None:
    config = CompileConfig.create({"source": f"{__name__}:build_layernorm_mlp",
                                   "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}]})  # fmt: skip
    fused = fused_graph(open_source(config), tmp_path, LogReporter())
    assert fused.path == tmp_path / MODEL_NAME and fused.path.is_file()
    ops = [node.op_type for node in onnx.load(str(fused.path)).graph.node]
    assert "LayerNormalization" in ops and "Gelu" in ops
    assert fused.source.kind == "factory" and fused.source.exporter in ("dynamo", "torchscript")
    assert [record.name for record in fused.inputs] == ["x"] and fused.inputs[0].shape == ["batch", 8]
    assert 0 <= fused.accuracy["max_relative_error"] < config.tolerance
    assert fused.reports[0].name == "canonicalize"
    assert not (tmp_path / "source.onnx").exists()  # a torch source is verified against torch itself
