"""The fields of a Hugging Face model directory's JSON files that the frontend reads, as transformers writes them.

The files are read with json.loads and not checked field by field: a field of another type fails where it is used,
as it would in transformers' own reader. Fields not listed here are still in the dict (read with `.get` as
`object`)."""

from __future__ import annotations

from typing import TypedDict


class ConfigJson(TypedDict, total=False):
    """config.json."""

    architectures: list[str]
    model_type: str
    is_encoder_decoder: bool
    vocab_size: int
    max_position_embeddings: int
    n_positions: int
    n_ctx: int
    dtype: str
    torch_dtype: str
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    # the sizes, under transformers' standard names or GPT-2's
    num_hidden_layers: int
    n_layer: int
    num_attention_heads: int
    n_head: int
    hidden_size: int
    n_embd: int
    num_key_value_heads: int | None
    head_dim: int | None
    multi_query: bool  # Falcon's and GPTBigCode's
    new_decoder_architecture: bool  # Falcon's
    per_layer_config: dict[str, dict[str, int]]  # layer index → its own sizes (Gemma 4's global layers)
    # multi-head latent attention (DeepSeek-V2/V3)
    kv_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_head_dim: int  # DeepSeek-V3.2's indexer key, cached beside the rotary key
    # which layers are which
    layer_types: list[str]
    layers_block_type: list[str]  # Granite 4's
    num_kv_shared_layers: int
    use_sliding_window: bool
    max_window_layers: int
    # stateful layers: Gated DeltaNet's (`linear_*`) and LFM2's short convolutions
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    conv_L_cache: int


class GenerationConfigJson(TypedDict, total=False):
    """generation_config.json."""

    eos_token_id: int | list[int] | None
