"""The fixed-size states a layer without keys and values caches in their place, as config.json sizes them:

- Gated DeltaNet's `linear_attention` layers (Qwen3.5/3.6, Qwen3-Next; `linear_*` keys): the last kernel - 1
  inputs of the depthwise convolution over q, k and v (`conv`) and the delta rule's state (`recurrent`);
- LFM2's short-convolution `conv` layers (`conv_L_cache`): the last L - 1 inputs of its depthwise convolution.

The layers' export is linear_attention.py (Gated DeltaNet) and short_convolution.py (LFM2)."""

from __future__ import annotations

from dataclasses import dataclass

from tensorsmith.compiler.frontend.config_json import ConfigJson


@dataclass(frozen=True)
class LayerStates:
    """The stateful layers (config.json's layer_types say `kind` for them) and each of their states' shape, batch
    excluded."""

    kind: str
    layers: tuple[int, ...]
    shapes: dict[str, tuple[int, ...]]


def layer_states(config: ConfigJson) -> LayerStates | None:
    """The states config.json's sizes give; None for a model without stateful layers."""
    if config.get("linear_num_value_heads"):
        key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        key_dim, value_dim = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
        conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        kernel = int(config.get("linear_conv_kernel_dim", 4))
        kind, shapes = (
            "linear_attention",
            {"conv": (conv_dim, kernel - 1), "recurrent": (value_heads, key_dim, value_dim)},
        )
    elif config.get("conv_L_cache"):
        kind, shapes = "conv", {"conv": (int(config["hidden_size"]), int(config["conv_L_cache"]) - 1)}
    else:
        return None
    layers = tuple(index for index, each in enumerate(config.get("layer_types") or []) if each == kind)
    return LayerStates(kind, layers, shapes) if layers else None
