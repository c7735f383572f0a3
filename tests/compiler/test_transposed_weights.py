"""Linear's weights written transposed by the export's first save, and canonicalize keeping that file: a real
torch module through the dynamo exporter, with a tied embedding table (gathered and projected)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from tensorsmith.compiler.frontend.exporters import released_proto
from tensorsmith.core import ir as core_ir
from tensorsmith.passes import Canonicalize


class TiedLm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.up = torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM's and Llama-3.2's are

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def exported(tmp_path: Path) -> tuple[onnx.ModelProto, Path, torch.nn.Module]:
    torch.manual_seed(0)
    module = TiedLm().eval()
    ids = torch.tensor([[1, 5, 7]])
    program = torch.onnx.export(module, (ids,), dynamo=True, optimize=True, input_names=["ids"], output_names=["y"])
    scratch = tmp_path / ".export"
    scratch.mkdir()
    return released_proto(program.model, scratch), scratch, module


def run(path: Path, ids: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": ids})[0]


def test_the_export_writes_transposed_weights_and_canonicalize_keeps_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_ir, "EXTERNAL_DATA_ABOVE", 0)  # the weights outside, as a real checkpoint's are
    proto, scratch, module = exported(tmp_path)
    initializers = {tensor.name for tensor in proto.graph.initializer}
    assert not [node for node in proto.graph.node if node.op_type == "Transpose" and node.input[0] in initializers]
    shapes = sorted(tuple(tensor.dims) for tensor in proto.graph.initializer if len(tensor.dims) == 2)
    assert shapes == [(16, 24), (16, 40), (24, 16), (40, 16)]  # the table kept beside its transpose: it is gathered
    weights = scratch / "exported.onnx.data"
    inode = weights.stat().st_ino

    path = tmp_path / "model.onnx"
    Canonicalize(opset=20).to_file(proto, path, owned=scratch)
    assert (tmp_path / "model.onnx.data").stat().st_ino == inode and not weights.exists()  # moved, not rewritten
    ids = np.array([[3, 1, 4]], np.int64)
    expected = module(torch.from_numpy(ids)).detach().numpy()
    np.testing.assert_allclose(run(path, ids), expected, rtol=1e-5, atol=1e-6)


def test_a_weights_file_outside_the_owned_directory_is_never_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_ir, "EXTERNAL_DATA_ABOVE", 0)
    proto, scratch, module = exported(tmp_path)
    path = tmp_path / "model.onnx"
    Canonicalize(opset=20).to_file(proto, path, owned=tmp_path / "elsewhere")  # a user's ONNX file, say
    assert (scratch / "exported.onnx.data").is_file() and (tmp_path / "model.onnx.data").is_file()
    assert (tmp_path / "model.onnx.data").stat().st_ino != (scratch / "exported.onnx.data").stat().st_ino
    ids = np.array([[2, 7, 9]], np.int64)
    np.testing.assert_allclose(run(path, ids), module(torch.from_numpy(ids)).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert os.path.getsize(tmp_path / "model.onnx.data") > 0
