"""The fixed-size states a linear-attention layer caches in place of keys and values, as config.json sizes them
(Gated DeltaNet's `linear_*` keys: Qwen3.5/3.6, Qwen3-Next); the layers' export is linear_attention.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STATE_KINDS = ("conv", "recurrent")


@dataclass(frozen=True)
class LinearStates:
    """The fixed shapes (batch excluded) of a linear-attention layer's states, from config.json."""

    conv: tuple[int, int]
    recurrent: tuple[int, int, int]

    def shape(self, kind: str) -> tuple[int, ...]:
        return self.conv if kind == "conv" else self.recurrent


def linear_states(config: dict[str, Any]) -> LinearStates | None:
    """Gated DeltaNet's state shapes from config.json's `linear_*` sizes; None for a model without them."""
    if not config.get("linear_num_value_heads"):
        return None
    key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    key_dim, value_dim = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    kernel = int(config.get("linear_conv_kernel_dim", 4))
    return LinearStates((conv_dim, kernel - 1), (value_heads, key_dim, value_dim))
