"""A large decoder's fused graph stores no weight: each one is a reference to its bytes in the checkpoint's own
files, hard-linked beside the graph (core/checkpoint_references.py), and every stage reads the values the fp32 graph
held."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.export_cache import ENV_VARIABLE
from tensorsmith.compiler.frontend.fused import fused_graph
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.core.checkpoint_references import STORED_SUFFIX, holds_references, take_references
from tensorsmith.core.errors import ExportError
from tensorsmith.core.graph_segments import segments
from tensorsmith.core.layerwise import layerwise
from tensorsmith.core.mapped_save import without_references
from tensorsmith.core.progress import LogReporter
from tensorsmith.runtime.manifest import checkpoint_links_path, external_data_path

LLAMA = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "num_attention_heads": 4, "num_key_value_heads": 2}


def _llama(directory: Path, layers: int = 4, tied: bool = False) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, vocab_size=256,
                                      tie_word_embeddings=tied, **LLAMA)  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16).save_pretrained(directory)
    return directory


def _weights(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer}


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_the_graph_refers_to_the_checkpoint_and_computes_what_its_weights_would(
    tmp_path: Path, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run a layer at a time, the fused graph holds references into the checkpoint file (a hard link beside it, no
    weights file of its own); its outputs are the graph's with its weights stored, and written out it holds the
    same fp32 weights, bit for bit. A tied embedding table is referred to twice: gathered, and transposed."""
    monkeypatch.delenv(ENV_VARIABLE)  # both graphs exported here (an entry holds the fp32 graph)
    checkpoint = _llama(tmp_path / "checkpoint", tied=tied)
    source = open_source(CompileConfig.create({"source": str(checkpoint), "targets": ["cpu"]}))
    graphs = {}
    for mode in ("always", "never"):
        (tmp_path / mode).mkdir()
        with layerwise(mode):
            graphs[mode] = fused_graph(source, tmp_path / mode, LogReporter())
    referring, stored = graphs["always"].path, graphs["never"].path
    structure = onnx.load(str(referring), load_external_data=False)
    assert holds_references(structure)
    # every weight of the checkpoint is read by reference (a tied table twice) but the 4 queries the attention-scale
    # pass rewrites: the output projection too, whose Transpose the exporter's optimizer would fold into fp32
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="np") as opened:
        stored_weights = len(list(opened.keys()))
    # a layerwise run's segments count a reference as the fp32 weight its session holds, not its bf16 bytes
    referred = [tensor for tensor in structure.graph.initializer if tensor.name.endswith(STORED_SUFFIX)]
    assert referred and all(tensor.data_type == onnx.TensorProto.BFLOAT16 for tensor in referred)
    widened = sum(4 * int(np.prod(tensor.dims)) for tensor in referred)
    assert sum(segment.weight_bytes for segment in segments(structure, 0)) >= widened
    assert len(take_references(structure, referring.parent)) == stored_weights - 4 + tied
    # what it stores itself: the weights a pass made (attention-scaled queries), the structure
    assert not external_data_path(referring).exists() and referring.stat().st_size < stored.stat().st_size / 3
    assert os.path.samefile(checkpoint_links_path(referring) / "model.safetensors", checkpoint / "model.safetensors")
    assert graphs["always"].accuracy["max_relative_error"] < 1e-4
    for computed, expected in zip(graphs["always"].verified.outputs, graphs["never"].verified.outputs, strict=True):  # type: ignore[union-attr]
        np.testing.assert_allclose(computed, expected, rtol=1e-5, atol=1e-5)

    without_references(referring)
    assert not checkpoint_links_path(referring).exists()
    assert not holds_references(onnx.load(str(referring), load_external_data=False))
    written, kept = _weights(referring), _weights(stored)
    assert written.keys() == kept.keys()
    for name, values in kept.items():
        assert np.array_equal(written[name], values), name


@pytest.mark.slow
def test_a_nan_in_a_referred_weight_is_refused_naming_it(tmp_path: Path) -> None:
    """The weights kept in the checkpoint are still read once at the export, as they are checked for NaN."""
    checkpoint = _llama(tmp_path / "checkpoint")
    path = checkpoint / "model.safetensors"
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    name = "model.layers.2.mlp.down_proj.weight"
    start = 8 + header_length + json.loads(path.read_bytes()[8 : 8 + header_length])[name]["data_offsets"][0]
    with path.open("r+b") as file:
        file.seek(start)
        file.write(b"\xff" * 4096)
    config = {"source": str(checkpoint), "targets": ["cpu"], "layerwise": "always"}
    with pytest.raises(ExportError, match=rf"{name} in .*model.safetensors holds 2048 NaN or infinite values"):
        compile(CompileConfig.create(config), tmp_path / "out")
    assert not (tmp_path / "out").exists()
