"""The fp32 graph's narrow twin: its weights that 16 bits hold exactly stored in bf16 or fp16 behind Casts, the
same outputs on ONNX Runtime, and used by the measuring sessions only while the graph is as it was. An fp16
variant's widened twin: its MatMuls in fp32 from Casts of the fp16 weights. Each is checked on the graph ONNX
Runtime optimizes from it: no weight widened into an fp32 initializer when the session opens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.compiler.variants.rewrite import rewrite_file
from tensorsmith.core import narrow_twin
from tensorsmith.core.narrow_twin import (
    TWIN_DISABLED_OPTIMIZERS,
    drop_twin,
    twin_directory,
    twin_of,
    write_twin,
    write_widened_twin,
)
from tensorsmith.core.sessions import measured_file, open_session, quiet_onnxruntime
from tensorsmith.passes.fp16 import ConvertToFp16

VOCABULARY, WIDTH = 512, 64


class TiedLanguageModel(torch.nn.Module):
    """A token table read by a Gather and, tied, by the output MatMul; one bf16 weight, one fp16, one neither."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCABULARY, WIDTH).bfloat16().float())
        self.bf16 = torch.nn.Parameter(torch.randn(WIDTH, WIDTH).bfloat16().float())
        self.fp16 = torch.nn.Parameter((torch.randn(WIDTH, WIDTH) * 1e-3).half().float())  # beyond bf16's precision
        self.fp32 = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.table[ids]
        hidden = torch.tanh(hidden @ self.bf16) + 1e3 * (hidden @ self.fp16) + 0.1 * (hidden @ self.fp32)
        return hidden @ self.table.T


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "model.onnx"
    torch.onnx.export(TiedLanguageModel(), (torch.zeros(2, 5, dtype=torch.int64),), str(path), dynamo=False,
                      input_names=["ids"], output_names=["logits"], opset_version=20)  # fmt: skip
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    monkeypatch.setattr(narrow_twin, "SAVES_AT_LEAST", 0)
    return path


def run(path: Path, ids: np.ndarray) -> np.ndarray:
    return np.asarray(open_session(path).run(None, {"ids": ids})[0])


def test_the_twin_holds_exact_weights_in_16_bits_and_computes_the_same(saved: Path) -> None:
    ids = np.random.default_rng(0).integers(0, VOCABULARY, (2, 5))
    expected = run(saved, ids)  # before the twin: the graph itself
    twin = write_twin(saved)
    assert twin is not None and twin_of(saved) == twin and measured_file(saved) == (twin, [*TWIN_DISABLED_OPTIMIZERS])
    types = {t.name: t.data_type for t in onnx.load(str(twin), load_external_data=False).graph.initializer
             if t.dims and np.prod(t.dims) >= WIDTH * WIDTH}  # fmt: skip
    # the table (and its transpose, which the exporter folded), the bf16 weight; the fp16 one; the fp32 one
    assert Counter(types.values()) == {onnx.TensorProto.BFLOAT16: 3, onnx.TensorProto.FLOAT16: 1,
                                       onnx.TensorProto.FLOAT: 1}  # fmt: skip
    assert (twin.parent / "model.onnx.data").stat().st_size < 0.6 * (saved.parent / "model.onnx.data").stat().st_size
    nodes = list(onnx.load(str(twin), load_external_data=False).graph.node)
    gather = next(node for node in nodes if node.op_type == "Gather")
    assert types[gather.input[0]] == onnx.TensorProto.BFLOAT16  # the 16-bit table, its rows cast after
    # each MatMul weight's Cast is tied to run after the Gather, not first in the graph with all the others
    narrow = {name for name, kind in types.items() if kind != onnx.TensorProto.FLOAT}
    tied = [at for at, node in enumerate(nodes) if node.op_type == "Reshape" and node.input[0] in narrow]
    assert len(tied) == 3 and min(tied) > nodes.index(gather)
    assert not any(node.op_type == "Cast" and node.input[0] in narrow for node in nodes)
    np.testing.assert_allclose(run(saved, ids), expected, rtol=1e-5, atol=1e-5)
    assert widened_by_onnxruntime(twin) == 1  # the fp32 weight, stored so; none of the 16-bit ones


def test_a_rewritten_graph_is_measured_itself_and_the_twin_goes_before_publishing(saved: Path) -> None:
    assert write_twin(saved) is not None
    model = onnx.load(str(saved))
    onnx.save(model, str(saved), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    assert twin_of(saved) is None and measured_file(saved) == (saved, [])
    assert write_twin(saved) is not None
    drop_twin(saved)
    assert twin_of(saved) is None and not twin_directory(saved).exists()


def test_no_twin_where_it_saves_too_little(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(narrow_twin, "SAVES_AT_LEAST", 1 << 30)
    assert write_twin(saved) is None and not twin_directory(saved).exists() and twin_of(saved) is None


def widened_by_onnxruntime(path: Path, disabled: tuple[str, ...] = TWIN_DISABLED_OPTIMIZERS) -> int:
    """fp32 weights of WIDTH x WIDTH or more in the graph ONNX Runtime optimizes from `path` with the optimizers
    `disabled` (a measuring session's, by default)."""
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    optimized = path.parent / "optimized.onnx"
    options.optimized_model_filepath = str(optimized)
    onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                 disabled_optimizers=list(disabled))  # fmt: skip
    weights = onnx.load(str(optimized), load_external_data=False).graph.initializer
    optimized.unlink()
    return sum(t.data_type == onnx.TensorProto.FLOAT and int(np.prod(t.dims)) >= WIDTH * WIDTH for t in weights)


def test_an_fp16_variants_widened_twin_keeps_its_weights_in_16_bits(saved: Path) -> None:
    variant = saved.parent / "fp16.onnx"
    rewrite_file(saved, [ConvertToFp16()], variant)
    ids = np.random.default_rng(1).integers(0, VOCABULARY, (2, 5))
    expected = run(variant, ids)  # ONNX Runtime's own fp16 handling: every weight widened when the session opens
    assert widened_by_onnxruntime(variant, disabled=()) == 4  # its own session's, as ONNX Runtime opens it
    twin = write_widened_twin(variant)
    assert twin is not None and twin.parent == variant.parent and twin_of(variant) == twin
    assert widened_by_onnxruntime(twin) == 0
    matmuls = [node for node in onnx.load(str(twin), load_external_data=False).graph.node if node.op_type == "MatMul"]
    assert len(matmuls) == 4 and all(name.endswith("/widened") for node in matmuls for name in node.input)
    np.testing.assert_allclose(run(variant, ids), expected, rtol=2e-2, atol=2e-2)  # fp16 products, rounded alike
    drop_twin(variant)
    assert not twin.exists() and twin_of(variant) is None and variant.is_file()


def test_a_tied_projection_is_widened_from_its_16_bit_table(saved: Path) -> None:
    """An engines-only fp16 variant reads its tied table through a Transpose (passes/tied_projection.py): the twin
    casts the table just before the projection and transposes it, which ONNX Runtime fuses into the MatMul, so no
    fp32 copy of the table (nor a transposed fp16 one) is made when the session opens."""
    from tensorsmith.passes.tied_projection import TiedProjection

    variant = saved.parent / "fp16.onnx"
    rewrite_file(saved, [ConvertToFp16(), TiedProjection()], variant)
    structure = onnx.load(str(variant), load_external_data=False)
    assert any(node.op_type == "Transpose" and node.input[0].startswith("table") for node in structure.graph.node)
    ids = np.random.default_rng(3).integers(0, VOCABULARY, (2, 5))
    expected = run(variant, ids)
    twin = write_widened_twin(variant)
    assert twin is not None and widened_by_onnxruntime(twin) == 0
    matmuls = [node for node in onnx.load(str(twin), load_external_data=False).graph.node if node.op_type == "MatMul"]
    assert len(matmuls) == 4 and all(name.endswith("/widened") for node in matmuls for name in node.input)
    np.testing.assert_allclose(run(variant, ids), expected, rtol=2e-2, atol=2e-2)
    drop_twin(variant)


def test_a_large_matmul_weight_is_cast_a_slice_of_columns_at_a_time(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vocabulary projection (WIDTH x VOCABULARY) above SLICE_ABOVE: MatMuls of 100 columns each, concatenated,
    each slice's start tied to the product before it; the same logits."""
    from tensorsmith.core import twin_nodes

    monkeypatch.setattr(twin_nodes, "SLICE_ABOVE", 4 * WIDTH * WIDTH)  # the projection only
    monkeypatch.setattr(twin_nodes, "SLICE_BYTES", 4 * WIDTH * 100)
    ids = np.random.default_rng(2).integers(0, VOCABULARY, (2, 5))
    expected = run(saved, ids)
    twin = write_twin(saved)
    assert twin is not None
    nodes = list(onnx.load(str(twin), load_external_data=False).graph.node)
    slices = [node for node in nodes if node.op_type == "Slice"]
    (concat,) = [node for node in nodes if node.op_type == "Concat"]
    assert len(slices) == len(concat.input) == 6  # 512 columns: five of 100, then 12
    tied = [node for node in nodes if node.op_type == "Size" and node.output[0].endswith("/size")
            and "/sliced/" in node.output[0]]  # fmt: skip
    assert [node.input[0] for node in tied[1:]] == list(concat.input[:-1])  # each slice after the product before
    np.testing.assert_allclose(run(saved, ids), expected, rtol=1e-5, atol=1e-5)
    assert widened_by_onnxruntime(twin) == 1  # still only the fp32 weight stored so
