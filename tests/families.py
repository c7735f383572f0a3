"""Tiny checkpoints of transformers' decoder families, built from each family's own config class: the sizes are
shrunk (hidden 64, 2 layers, 4 heads, 2 of them for keys and values, 4 experts, a vocabulary of 256), everything
else is the class's default, so that each family's own structure (norms, rotary variants, routing, MLA) is what
is exported. Weights are seeded and scaled up so that greedy choices are not near-ties, saved in bf16 as
checkpoints are published."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The decoder families tensorsmith claims: each compiles from a tiny bf16 checkpoint for the cpu target and
# generates transformers' greedy tokens (tests/compiler/test_family_sweep.py; docs/families.md).
FAMILIES = (
    # dense attention: Llama's lineage and its relatives
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "vaultgemma",
    "phi", "phi3", "granite", "granite_swa", "helium", "olmo", "olmo2", "olmo3", "flex_olmo", "cohere", "cohere2",
    "glm", "glm4", "internlm3", "exaone4", "ernie4_5", "hunyuan_v1_dense", "seed_oss", "smollm3", "apertus",
    "apertus1p5_text", "llama4_text", "arcee", "bitnet", "cwm", "diffllama", "doge", "nanochat", "nemotron",
    "persimmon", "stablelm", "starcoder2", "youtu", "hyperclovax", "iquestcoder", "jais2", "laguna", "mellum",
    "solar_open", "aria_text", "gemma4_text", "gemma3n_text",
    # GPT-2's lineage, learned or ALiBi positions, parallel blocks
    "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gptj", "codegen", "bloom", "falcon", "opt",
    "xglm", "ctrl", "modernbert-decoder", "mpt",
    # sparse mixtures of experts (routed experts only: compiler/frontend/routed_experts.py)
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "phimoe", "jetmoe", "gpt_oss",
    "ernie4_5_moe", "hunyuan_v1_moe", "glm4_moe", "dots1", "minimax_m2", "exaone_moe", "cohere2_moe", "afmoe",
    # multi-head latent attention with its latent cache (compiler/frontend/latent_attention.py)
    "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3",
    # DeepSeek-V3.2's sparse attention: its indexer's choice over the latent cache (frontend/indexed_attention.py)
    "deepseek_v32",
    # Gated DeltaNet's linear attention beside full attention (compiler/frontend/linear_attention.py)
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
    # LFM2's short convolutions beside full attention (compiler/frontend/short_convolution.py)
    "lfm2", "lfm2_moe",
)  # fmt: skip
# Families refused before the export, with what their config.json says they hold.
REFUSED = {
    "kimi_linear": "linear_attention", "minimax": "linear_attention", "olmo_hybrid": "linear_attention",
    "jamba": "recurrent", "falcon_h1": "recurrent", "nemotron_h": "linear_attention",
    "recurrent_gemma": "recurrent",
}  # fmt: skip
# config keys set where the family's config has them (under their own names, or transformers' attribute_map's)
SIZES: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2, "n_shared_experts": 1,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "sliding_window": 8, "attention_chunk_size": 8,
    "rotary_dim": 8, "attention_types": [[["global", "local"], 1]], "expert_ffn_hidden_size": 32, "zero_expert_num": 2,
    "num_dense_layers": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "num_kv_shared_layers": 0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8,
    "tie_word_embeddings": False,
}  # fmt: skip


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's config class with the sizes above (those it has) and `overrides`."""
    import transformers

    config_class = transformers.CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    names = {**{key: key for key in defaults}, **{alias: key for alias, key in config_class.attribute_map.items()}}
    sizes = {key: value for key, value in SIZES.items() if key in names and names[key] in defaults}
    if "qk_rope_head_dim" in defaults:  # latent attention: head_dim is the rotary part's, every head its own kv head
        sizes["head_dim"] = SIZES["qk_rope_head_dim"]
        sizes = {key: value for key, value in sizes.items() if key != "head_dim" or key in defaults}
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if "linear_attention" in (defaults.get("layer_types") or []):  # a hybrid: one layer of each kind
        sizes["layer_types"] = ["linear_attention", "full_attention"]
    if "conv_L_cache" in defaults:  # LFM2: a short convolution, then attention
        sizes["layer_types"] = ["conv", "full_attention"]
    return config_class(**{**sizes, **overrides})


def save_family(model_type: str, directory: Path, **overrides: Any) -> Any:
    """A seeded bf16 checkpoint of the family in `directory`; returns transformers' float32 model of it."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type, **overrides)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    model_class = getattr(transformers, architecture)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zeros would hide its use
                buffer.normal_(0, 0.5)
    model.to(torch.bfloat16).save_pretrained(str(directory))
    return model_class.from_pretrained(str(directory), dtype=torch.float32, experts_implementation="batched_mm"
                                       ).eval()  # fmt: skip
