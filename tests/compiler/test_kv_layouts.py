"""Decoders whose cache holds other than num_key_value_heads heads, from Hugging Face directories (small seeded
checkpoints saved here): multi-query attention (falcon-7b's, FalconConfig's default, and GPTBigCode's: one key and
value head) and Falcon's new decoder architecture (falcon-40b's: transformers before 5.25 broadcast its kv heads to
every head before the cache, 5.25 caches its num_kv_heads). Each compiles with the cache transformers' own holds,
and `generate` gives exactly transformers' greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tests.compiler.test_decoders import COMMON, assert_greedy_tokens_match

# the architecture, its config's fields, the kv heads the cache may hold (of 4 attention heads)
LAYOUTS: dict[str, tuple[str, dict[str, Any], set[int]]] = {
    "falcon multi-query": ("Falcon", {}, {1}),
    "falcon new decoder architecture": ("Falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, {2, 4}),
    "gpt_bigcode multi-query": ("GPTBigCode", {"multi_query": True}, {1}),
}
SIZES = {
    "Falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256},
    "GPTBigCode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
}


def save_checkpoint(family: str, directory: Path, **fields: Any) -> Any:
    """A seeded random model, weights scaled up so that greedy choices are not near-ties."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**SIZES[family], **fields, **COMMON)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.15)
    model.save_pretrained(str(directory))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cache_layout_compiles_and_generates_transformers_tokens(layout: str, tmp_path: Path) -> None:
    family, fields, possible = LAYOUTS[layout]
    reference = save_checkpoint(family, tmp_path / "checkpoint", **fields)
    with torch.no_grad():
        cache = reference(torch.tensor([[3, 4, 5]]), use_cache=True).past_key_values
    kv_heads = cache.layers[0].keys.shape[1]  # what this transformers' own cache holds
    assert kv_heads in possible
    written = json.loads((tmp_path / "checkpoint" / "config.json").read_text())
    if written.pop("num_key_value_heads", None) is not None:  # as transformers before 5.25 wrote it: the compile
        (tmp_path / "checkpoint" / "config.json").write_text(json.dumps(written))  # asks transformers' config
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.generation is not None and manifest.generation.kv_heads == kv_heads
    assert_greedy_tokens_match(reference, tmp_path / "out")
