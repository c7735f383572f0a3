"""Every decoder family tensorsmith claims (tests/families.py), built tiny from transformers' own config class and
saved in bf16: compiled for the cpu target, it generates transformers' greedy tokens for a left-padded batch whose
prompt is long enough for a mixture of experts to take its prefill form (every expert over the prompt) and then
its decode form (the chosen experts' weights gathered). The families that keep another state than a KV cache are
refused before the export, naming what they hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.huggingface import read_model_directory
from tensorsmith.core.errors import ConfigError
from tensorsmith.runtime import load
from tests.families import FAMILIES, REFUSED, save_family, tiny_config

NEW_TOKENS = 12


@pytest.mark.families
@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_family_generates_transformers_tokens(model_type: str, tmp_path: Path) -> None:
    reference = save_family(model_type, tmp_path / "checkpoint")
    prompt = np.random.default_rng(0).integers(3, 256, (2, 20)).astype(np.int64)
    mask = np.ones_like(prompt)
    mask[1, :6] = 0  # the second prompt is 14 tokens, left padded
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.from_numpy(prompt), attention_mask=torch.from_numpy(mask),
                                      do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      eos_token_id=None, pad_token_id=0).numpy()  # fmt: skip
    compile(CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu"]}), tmp_path / "out")
    with load(tmp_path / "out", backend="onnxruntime") as model:
        assert model.manifest.generation is not None
        generated = model.generate(prompt, mask, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert np.array_equal(generated, expected), f"{model_type}: {generated[:, 20:]} != {expected[:, 20:]}"


@pytest.mark.families
@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_family_with_recurrent_layers_is_refused_by_name(model_type: str, tmp_path: Path) -> None:
    save_family(model_type, tmp_path / "checkpoint")
    with pytest.raises(ConfigError, match=f"{REFUSED[model_type]}.*model_type '{model_type}'"):
        read_model_directory(tmp_path / "checkpoint")


@pytest.mark.families
def test_caches_shared_between_layers_are_refused_by_name(tmp_path: Path) -> None:
    config = tiny_config("gemma4_text", num_hidden_layers=3, num_kv_shared_layers=1,
                         layer_types=["sliding_attention", "full_attention", "full_attention"])  # fmt: skip
    config.architectures = ["Gemma4ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="last 1 layers share earlier layers' keys and values"):
        read_model_directory(tmp_path)
