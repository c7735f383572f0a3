"""LFM2's short-convolution layers (Liquid AI's LFM2 and LFM2-MoE) as the export writes them.

A `conv` layer gates a depthwise causal convolution (kernel `conv_L_cache`, 3) between two of its input
projection's thirds and the third: y = C · conv(B · x), then `out_proj`. Its state is the convolution's left
context, the last L - 1 values of B · x (`past_key_values.N.conv [batch, hidden, L - 1]`), which transformers
keeps in its cache and updates in place. The forward below reads and returns it as the Gated DeltaNet's
convolution does (linear_attention.causal_convolution: one path for prompt and token), with padding positions
zeroed first, as transformers zeroes them.

A module is recognised by what it holds (a depthwise `conv`, `in_proj` three times as wide as `out_proj`'s
input, `out_proj`), not by its family.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from tensorsmith.compiler.frontend.linear_attention import causal_convolution, layer_and_inputs
from tensorsmith.compiler.frontend.module_protocols import ShortConvolution

if TYPE_CHECKING:
    from transformers.cache_utils import Cache


def is_short_convolution(module: torch.nn.Module) -> bool:
    conv, in_proj, out_proj = (getattr(module, name, None) for name in ("conv", "in_proj", "out_proj"))
    return (
        isinstance(conv, torch.nn.Conv1d)
        and isinstance(in_proj, torch.nn.Linear)
        and isinstance(out_proj, torch.nn.Linear)
        and conv.groups == conv.in_channels
        and in_proj.out_features == 3 * out_proj.in_features
    )


def rewrite_short_convolution(model: torch.nn.Module) -> int:
    """Swap every short-convolution module's forward in `model` (in place); returns how many."""
    layers = [module for module in model.modules() if is_short_convolution(module)]
    for module in layers:
        module.forward = types.MethodType(_forward, module)
    return len(layers)


def _forward(
    self: ShortConvolution,
    hidden_states: torch.Tensor,
    cache: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    layer, hidden_states = layer_and_inputs(self, cache, hidden_states, attention_mask)
    gate_in, gate_out, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
    convolved, layer.states["conv"] = causal_convolution(self.conv, gate_in * x, layer.states["conv"])
    return self.out_proj((gate_out * convolved).transpose(-1, -2).contiguous())
