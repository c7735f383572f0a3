"""A decoder's export traces two layers and stamps the rest from the second (compiler/frontend/layer_stamping.py):
the stamped graph is the one a trace of every layer gives, op for op and weight for weight, it matches
transformers (the compile's verification), and its nodes name their own layers' modules. Layers that differ are
traced whole."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

from tensorsmith.compiler import CompileConfig
from tensorsmith.compiler.frontend.fused import FusedGraph, fused_graph
from tensorsmith.compiler.frontend.layer_stamping import leading_layers, per_layer_variation
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.core.module_paths import MODULE_KEY
from tensorsmith.core.progress import LogReporter
from tests.families import save_family

COMMON = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
LAYERS = 4
DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip


def _model(family: str) -> Any:
    import transformers as t

    configs = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**DECODER, **COMMON)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=256, **COMMON)),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=LAYERS,
                num_attention_heads=4,
                max_position_embeddings=256,
                **COMMON,
            )
        ),
        "opt": lambda: t.OPTForCausalLM(
            t.OPTConfig(
                hidden_size=64,
                ffn_dim=128,
                num_hidden_layers=LAYERS,
                num_attention_heads=4,
                max_position_embeddings=256,
                word_embed_proj_dim=64,
                **COMMON,
            )
        ),
        # sliding and global layers alternate (config.json's layer_types): traced whole
        "gemma2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**DECODER, head_dim=16, sliding_window=8, **COMMON)),
    }
    torch.manual_seed(0)
    return configs[family]().eval()


def _fused(directory: Path, out: Path, **options: Any) -> FusedGraph:
    config = CompileConfig.create({"source": str(directory), "targets": ["cpu"], **options})
    out.mkdir()
    return fused_graph(open_source(config), out, LogReporter())  # verifies against transformers (1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt"])  # llama: below; its kin (Phi3, Qwen2) alike
def test_families_stamp_their_layers_and_match_transformers(family: str, tmp_path: Path) -> None:
    _model(family).save_pretrained(tmp_path / "checkpoint")
    fused = _fused(tmp_path / "checkpoint", tmp_path / "out")
    assert fused.source.traced_layers == 2
    assert fused.accuracy["max_relative_error"] < 1e-4
    paths = {entry.value for node in fused.model.graph.node for entry in node.metadata_props if entry.key == MODULE_KEY}
    assert any(f".{LAYERS - 1}." in path for path in paths), "the last layer's nodes name its modules"


@pytest.mark.slow
def test_the_stamped_graph_is_the_whole_trace(tmp_path: Path) -> None:
    _model("llama").save_pretrained(tmp_path / "checkpoint")
    stamped = _fused(tmp_path / "checkpoint", tmp_path / "stamped")
    traced = _fused(tmp_path / "checkpoint", tmp_path / "traced", trace_every_layer=True)
    assert (stamped.source.traced_layers, traced.source.traced_layers) == (2, None)

    def ops(model: onnx.ModelProto) -> Counter[str]:
        return Counter(node.op_type for node in model.graph.node)

    def weights(model: onnx.ModelProto) -> set[str]:
        """By value: folded weights have the folder's names; the whole trace's optimizer also merges equal weights
        (norm weights that start as ones), which the stamped layers keep one a layer."""
        return {hashlib.sha256(t.raw_data).hexdigest() for t in model.graph.initializer if t.raw_data}

    assert ops(stamped.model) == ops(traced.model)
    assert [v.name for v in stamped.model.graph.input] == [v.name for v in traced.model.graph.input]
    assert [v.name for v in stamped.model.graph.output] == [v.name for v in traced.model.graph.output]
    assert weights(stamped.model) == weights(traced.model) and len(weights(traced.model)) >= 7 * LAYERS


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "options", "traced"),
    [("qwen2_moe", {}, 2), ("deepseek_v3", {"first_k_dense_replace": 2}, 4)],
    ids=["every-layer-a-mixture", "two-dense-layers-first"],
)
def test_mixtures_of_experts_stamp_their_layers_as_their_whole_trace(
    family: str, options: dict[str, int], traced: int, tmp_path: Path
) -> None:
    """A mixture's layer holds an If whose branches read the layer's stacked experts from outside them: each
    stamped layer must read its own (a clone reading the template's would miss transformers by far more than
    1e-4). DeepSeek's dense first layers are traced as they are and the stamping starts after them; the trace
    shares the first mixture layer's pair count with the next (lent arithmetic, not a difference)."""
    save_family(family, tmp_path / "checkpoint", num_hidden_layers=traced + 2, **options)
    stamped = _fused(tmp_path / "checkpoint", tmp_path / "stamped")
    whole = _fused(tmp_path / "checkpoint", tmp_path / "whole", trace_every_layer=True)
    assert (stamped.source.traced_layers, whole.source.traced_layers) == (traced, None)
    assert stamped.accuracy["max_relative_error"] < 1e-4
    counts = [Counter(node.op_type for node in fused.model.graph.node) for fused in (stamped, whole)]
    assert counts[0] == counts[1] and counts[0]["If"] == traced + 2 - options.get("first_k_dense_replace", 0)
    paths = {e.value for node in stamped.model.graph.node for e in node.metadata_props if e.key == MODULE_KEY}
    assert any(f".{traced + 1}.mlp" in path for path in paths), "the last layer's nodes name its modules"


@pytest.mark.slow
def test_layers_that_differ_are_traced_whole(tmp_path: Path) -> None:
    _model("gemma2").save_pretrained(tmp_path / "checkpoint")
    fused = _fused(tmp_path / "checkpoint", tmp_path / "out")
    assert fused.source.traced_layers is None and fused.accuracy["max_relative_error"] < 1e-4


def test_config_json_says_when_layers_differ() -> None:
    assert per_layer_variation({"layer_types": ["full_attention"] * 4}, 4) is None
    assert "layer_types" in str(per_layer_variation({"layer_types": ["sliding_attention", "full_attention"] * 2}, 4))
    assert "mlp_only_layers" in str(per_layer_variation({"mlp_only_layers": [0]}, 4))
    assert per_layer_variation({"mlp_only_layers": []}, 4) is None
    assert "max_window_layers" in str(per_layer_variation({"use_sliding_window": True, "max_window_layers": 2}, 4))
    assert per_layer_variation({"first_k_dense_replace": 3}, 8) is None  # traced as they are, then stamped
    assert (leading_layers({"first_k_dense_replace": 3}), leading_layers({"first_k_dense_replace": 0})) == (3, 0)
