"""Gated DeltaNet layers (Qwen3.5/3.6's and Qwen3-Next's linear attention) as the export writes them.

A linear-attention layer keeps two fixed-size states instead of keys and values: the last `kernel - 1` inputs
of its causal depthwise convolution (`conv [batch, conv_dim, kernel - 1]`) and the delta rule's recurrent
state (`recurrent [batch, value_heads, key_dim, value_dim]`). transformers' forward picks a path by the step's
length (the chunked rule for a prompt, the recurrent one for a token) and updates its cache in place; neither
exports. The forward below is one path for both:

    conv:       x' = concat(conv_state, x) over time, depthwise conv without padding, SiLU; conv_state' = the
                last kernel - 1 columns of x'
    recurrence: the gated delta rule chunk by chunk, an ONNX Scan over chunks of up to 64 tokens
                (delta_rule.py: a decode step is one chunk of one token)

A zero state is the prompt's start (transformers pads the convolution with zeros and starts from a zero state),
so prefill and decode are the same graph. Left padding is harmless: the padding positions' inputs are zeroed
(transformers' `apply_mask_to_padding_states`), which leaves a zero state zero. TensorRT for RTX builds the
Scan (checked for SM86 and SM120).

A module is recognised by what it holds (`A_log`, `dt_bias`, `conv1d` and its input projections), not by its
family.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from tensorsmith.compiler.frontend.delta_rule import gated_delta_rule
from tensorsmith.compiler.frontend.module_protocols import GatedDeltaNet, StatefulLayer
from tensorsmith.core.errors import ExportError

# the input projections of the two forms transformers writes (Qwen3.5's split ones; Qwen3-Next's fused ones)
SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
FUSED_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    held = ("A_log", "dt_bias", "conv1d", "norm", "out_proj")
    return all(hasattr(module, name) for name in held) and (
        all(hasattr(module, name) for name in SPLIT_PROJECTIONS)
        or all(hasattr(module, name) for name in FUSED_PROJECTIONS)
    )


def rewrite_linear_attention(model: torch.nn.Module) -> int:
    """Swap every Gated DeltaNet module's forward in `model` (in place) for the one below; returns how many."""
    layers = [module for module in model.modules() if is_gated_delta_net(module)]
    for module in layers:
        module.forward = types.MethodType(_forward, module)
    return len(layers)


@contextlib.contextmanager
def token_masks_while_tracing(model: torch.nn.Module) -> Iterator[None]:
    """transformers hands a linear-attention layer the padding mask's last columns, except for one new token
    (a generated token is never padding), which a graph whose sequence length is a variable cannot tell
    apart: while tracing, every step gets its columns (a decode step's is 1, so the product changes nothing)."""
    module = sys.modules[type(model).__module__]
    original = getattr(module, "create_recurrent_attention_mask", None)
    if original is None:
        yield
        return

    def new_token_mask(
        attention_mask: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor, **_: object
    ) -> torch.Tensor | None:
        if attention_mask is None or attention_mask.ndim != 2:
            return None
        return attention_mask[:, -inputs_embeds.shape[1] :]

    module.create_recurrent_attention_mask = new_token_mask  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.create_recurrent_attention_mask = original  # type: ignore[attr-defined]


class StateLayer(LinearAttentionCacheLayerMixin):
    """A stateful layer's place in the traced cache: the states it was given by kind, replaced (not copied
    into) by the ones it computes, so that the graph returns them. A linear-attention layer to transformers'
    cache, which so finds the first attention layer for the masks' offsets."""

    def __init__(self, states: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.states = states

    def get_seq_length(self) -> int:  # a state has no length
        return 0

    def lazy_initialization(self, *args: object, **kwargs: object) -> None:
        raise _not_rewritten()

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0) -> torch.Tensor:
        raise _not_rewritten()

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0) -> torch.Tensor:
        raise _not_rewritten()


def layer_and_inputs(
    module: StatefulLayer, cache: Cache | None, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[StateLayer, torch.Tensor]:
    """A stateful layer's states in the traced cache, and its inputs with the padding positions zeroed (as
    transformers zeroes them: they leave the states as they are, zero before the prompt)."""
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if not isinstance(layer, StateLayer):
        raise ExportError(f"{type(module).__name__} {module.layer_idx} was given no state", hint="a tensorsmith export")
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
    return layer, hidden_states


def _not_rewritten() -> ExportError:
    return ExportError(
        "a linear-attention layer's states were set through transformers' cache",
        hint="its forward was not rewritten (compiler/frontend/linear_attention.py)",
    )


def _projections(self: GatedDeltaNet, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed_qkv [b, s, conv_dim], z [b, s, value_heads, value_dim], b, a [b, s, value_heads])."""
    batch, length, _ = hidden.shape
    if hasattr(self, "in_proj_qkv"):
        z = self.in_proj_z(hidden).reshape(batch, length, -1, self.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)
    query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
    mixed = torch.cat([t.reshape(batch, length, -1) for t in (query, key, value)], dim=-1)
    return mixed, z, b, a


def causal_convolution(
    conv: torch.nn.Conv1d, inputs: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution over [state | inputs] (channels first, without padding: the state is the
    left context, zeros before a prompt): (its output at the new positions, the next state, the last
    kernel - 1 columns)."""
    full = torch.cat([state, inputs.to(state.dtype)], dim=-1)
    out = F.conv1d(full, conv.weight, conv.bias, padding=0, groups=full.shape[1])
    return out.to(inputs.dtype), full[:, :, full.shape[-1] - state.shape[-1] :]


def _forward(
    self: GatedDeltaNet,
    hidden_states: torch.Tensor,
    cache: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    layer, hidden_states = layer_and_inputs(self, cache, hidden_states, attention_mask)
    batch, length, _ = hidden_states.shape
    mixed, z, b, a = _projections(self, hidden_states)
    convolved, layer.states["conv"] = causal_convolution(self.conv1d, mixed.transpose(1, 2), layer.states["conv"])
    convolved = F.silu(convolved)
    query, key, value = torch.split(convolved.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, self.head_k_dim)
    key = key.reshape(batch, length, -1, self.head_k_dim)
    value = value.reshape(batch, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    out, recurrent = gated_delta_rule(query, key, value, g, beta, layer.states["recurrent"])
    layer.states["recurrent"] = recurrent.to(layer.states["recurrent"].dtype)
    out = self.norm(out.to(hidden_states.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, length, -1))
