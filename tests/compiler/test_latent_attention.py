"""DeepSeek's multi-head latent attention: a tiny DeepSeek-V3 checkpoint in its real layout (MLA with a query
LoRA, a dense first layer, then shared + routed experts with V3's group routing and score-correction bias) compiles
with the compressed latent as its cache, generates transformers' greedy tokens, and builds fp16 and INT4 engines;
the decompressed cache (`mla_cache = "full"`) gives the same tokens from a cache many times larger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.core.errors import ConfigError
from tensorsmith.runtime import load
from tests.compiler.test_decoders import assert_greedy_tokens_match
from tests.families import save_family


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("deepseek_v3") / "checkpoint"
    reference = save_family("deepseek_v3", directory)
    layers = reference.model.layers
    assert not hasattr(layers[0].mlp, "gate") and layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    return directory, reference


def _cache_values_per_token(artifact: Path) -> int:
    """Values cached per token and layer: the past key's and value's heads × widths."""
    with load(artifact, backend="onnxruntime") as model:
        shapes = {spec.name: spec.shape for spec in model.inputs if spec.name.startswith("past_key_values.0.")}
    return sum(int(shape[1]) * int(shape[3]) for shape in shapes.values())


@pytest.mark.slow
def test_the_latent_cache_generates_transformers_tokens_and_builds_engines(
    deepseek_v3: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    checkpoint, reference = deepseek_v3
    # fp16, the form checked here (its bf16 default builds too)
    config = CompileConfig.create(
        {"source": str(checkpoint), "targets": ["cpu", "sm_86", "sm_120"], "precision": "fp16"}
    )
    manifest = compile(config, tmp_path / "latent").manifest
    generation = manifest.generation
    assert generation is not None and generation.cache_form == "latent"
    # one head: the kv_lora_rank-wide latent as the key, the qk_rope-wide rotary key as the value
    assert (generation.kv_heads, generation.head_dim, generation.value_head_dim) == (1, 32, 8)
    for target in manifest.targets[1:]:
        assert target.status == "built" and target.variant == "fp16", target.reason
    assert_greedy_tokens_match(reference, tmp_path / "latent")
    assert _cache_values_per_token(tmp_path / "latent") == 32 + 8

    full = CompileConfig.create({"source": str(checkpoint), "targets": ["cpu"], "mla_cache": "full"})
    manifest = compile(full, tmp_path / "full").manifest
    assert manifest.generation is not None and manifest.generation.cache_form == "per_head"
    assert_greedy_tokens_match(reference, tmp_path / "full")
    # every head's keys (qk_nope 16 + qk_rope 8) and values (16): 4 x 40 against 40
    assert _cache_values_per_token(tmp_path / "full") == 4 * (24 + 16)


@pytest.mark.slow
def test_int4_engines_build_for_the_latent_cache(deepseek_v3: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    checkpoint, _ = deepseek_v3
    config = CompileConfig.create({"source": str(checkpoint), "targets": ["cpu", "sm_86", "sm_120"],
                                   "precision": "int4", "int4_algorithm": "rtn", "int4_block_size": 32})  # fmt: skip
    manifest = compile(config, tmp_path / "int4").manifest
    for target in manifest.targets[1:]:
        assert target.status == "built", target.reason
    with load(tmp_path / "int4", backend="onnxruntime") as model:
        tokens = model.generate(np.array([[5, 6, 7, 8]], np.int64), max_new_tokens=4, eos_token_id=[])
    assert tokens.shape == (1, 8)


@pytest.fixture(scope="module")
def deepseek_v32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """DeepSeek-V3.2: V3's layout with its sparse attention's indexer, choosing 8 tokens of each query's (the tiny
    config's index_topk): prompts longer than that make the choice matter."""
    directory = tmp_path_factory.mktemp("deepseek_v32") / "checkpoint"
    reference = save_family("deepseek_v32", directory)
    assert reference.config.index_topk == 8 and reference.config.layer_types[0] == "indexed_attention"
    return directory, reference


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_indexed_attention_generates_transformers_tokens_and_builds_engines(
    deepseek_v32: tuple[Path, torch.nn.Module], precision: str, tmp_path: Path
) -> None:
    checkpoint, reference = deepseek_v32
    options = {"int4_algorithm": "rtn", "int4_block_size": 32} if precision == "int4" else {}
    config = CompileConfig.create(
        {"source": str(checkpoint), "targets": ["cpu", "sm_86", "sm_120"], "precision": precision, **options}
    )
    manifest = compile(config, tmp_path / precision).manifest
    generation = manifest.generation
    assert generation is not None and generation.cache_form == "latent_indexed"
    # the latent (32) as the key; the rotary key (8) and the indexer's key (16) as the value
    assert (generation.kv_heads, generation.head_dim, generation.value_head_dim) == (1, 32, 8 + 16)
    for target in manifest.targets[1:]:
        assert target.status == "built" and target.variant == precision, target.reason
    if precision == "fp16":  # the cpu's fp32 variant: transformers' tokens (the family sweep checks a padded batch)
        assert_greedy_tokens_match(reference, tmp_path / precision)


def test_the_decompressed_cache_of_indexed_attention_is_refused_before_the_export(
    deepseek_v32: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    checkpoint, _ = deepseek_v32
    config = CompileConfig.create({"source": str(checkpoint), "targets": ["cpu"], "mla_cache": "full"})
    with pytest.raises(ConfigError, match="deepseek_v32's indexer keys have no place in the decompressed cache"):
        compile(config, tmp_path / "full")
    assert not (tmp_path / "full").exists()
