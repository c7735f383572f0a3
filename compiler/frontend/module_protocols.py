"""What the export's own forwards read of transformers' modules and caches. The modules are recognised by what they
hold, not by their class (latent_attention.py, linear_attention.py, short_convolution.py, complex_rotary.py), so
their types here are the attributes read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


class LatentAttention(Protocol):
    """A multi-head latent attention module (DeepSeek-V2/V3's, LongCat-Flash's)."""

    config: PretrainedConfig
    layer_idx: int
    num_heads: int
    qk_head_dim: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scaling: float
    q_proj: torch.nn.Module  # without a query LoRA (q_lora_rank None); with one, the next three
    q_a_proj: torch.nn.Module
    q_a_layernorm: torch.nn.Module
    q_b_proj: torch.nn.Module
    kv_a_proj_with_mqa: torch.nn.Module
    kv_a_layernorm: torch.nn.Module
    kv_b_proj: torch.nn.Linear
    o_proj: torch.nn.Module


class StatefulLayer(Protocol):
    """A layer whose states the traced cache holds (linear_attention.StateLayer), by its index."""

    layer_idx: int


class GatedDeltaNet(StatefulLayer, Protocol):
    """A Gated DeltaNet linear-attention module (Qwen3.5/3.6's, Qwen3-Next's)."""

    key_dim: int
    value_dim: int
    head_k_dim: int
    head_v_dim: int
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    conv1d: torch.nn.Conv1d
    norm: torch.nn.Module  # gated: norm(x, z)
    out_proj: torch.nn.Module
    in_proj_qkv: torch.nn.Module  # Qwen3.5's split input projections
    in_proj_z: torch.nn.Module
    in_proj_b: torch.nn.Module
    in_proj_a: torch.nn.Module
    in_proj_qkvz: torch.nn.Module  # Qwen3-Next's fused ones
    in_proj_ba: torch.nn.Module

    def fix_query_key_value_ordering(
        self, mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor
    ) -> tuple[torch.Tensor, ...]: ...


class ShortConvolution(StatefulLayer, Protocol):
    """An LFM2 short-convolution module."""

    conv: torch.nn.Conv1d
    in_proj: torch.nn.Linear
    out_proj: torch.nn.Linear


class RotaryEmbedding(Protocol):
    """A rotary embedding module: its inverse frequencies and scale."""

    inv_freq: torch.Tensor
    attention_scaling: float


class CachedKeysValues(Protocol):
    """A transformers cache layer after the forward, its keys and values set."""

    keys: torch.Tensor
    values: torch.Tensor
