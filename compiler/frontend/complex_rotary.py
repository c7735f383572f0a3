"""Rotary embeddings written with complex numbers (DeepSeek-V2's and Llama 4's `freqs_cis`: torch.polar, then
view_as_complex on the query and key), which no exporter takes, in real arithmetic.

The rotary module returns its angles' cosines and sines (`PairAngles`, scaled as it scales the complex numbers);
each adjacent pair (x0, x1) of the query and key, the complex number x0 + i·x1, is multiplied by cos + i·sin:

    (x0·cos - x1·sin, x0·sin + x1·cos)

A module is recognised by what it computes (an `inv_freq` and torch.polar in its forward), a family's rotation
function by view_as_complex in its code.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from tensorsmith.compiler.frontend.module_protocols import RotaryEmbedding


class PairAngles(NamedTuple):
    """A complex rotary embedding's rotation as real numbers: [batch, sequence, rotary/2] each."""

    cos: torch.Tensor
    sin: torch.Tensor

    # the attention moves freqs_cis to its device; the arguments are Tensor.to's, of its several signatures
    def to(self, *args: Any, **kwargs: Any) -> PairAngles:
        return PairAngles(self.cos.to(*args, **kwargs), self.sin.to(*args, **kwargs))


def returns_complex_rotation(module: torch.nn.Module) -> bool:
    """A rotary embedding whose forward builds complex numbers."""
    forward = type(module).forward
    code = getattr(forward, "__wrapped__", forward).__code__
    return hasattr(module, "inv_freq") and "polar" in code.co_names


def rewrite_complex_rotary(model: torch.nn.Module) -> int:
    """Swap every complex rotary embedding's forward in `model` (in place) for its angles; returns how many."""
    modules = [module for module in model.modules() if returns_complex_rotation(module)]
    for module in modules:
        module.forward = types.MethodType(_real_rotation_forward, module)
    return len(modules)


def _real_rotation_forward(self: RotaryEmbedding, x: torch.Tensor, position_ids: torch.Tensor) -> PairAngles:
    angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    scale = self.attention_scaling
    return PairAngles(angles.cos() * scale, angles.sin() * scale)


def rotate_pairs(x: torch.Tensor, angles: PairAngles, heads_axis: int) -> torch.Tensor:
    """(x0 + i·x1)·(cos + i·sin) for each adjacent pair of x's last dim, as torch.view_as_complex reads it; the
    angles broadcast over x's heads at `heads_axis` (1: [batch, heads, sequence, d]; 2: [batch, sequence, heads,
    d])."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos.unsqueeze(heads_axis), angles.sin.unsqueeze(heads_axis)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


def _apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: PairAngles) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's apply_rotary_emb ([batch, sequence, heads, d] queries and keys) over PairAngles."""
    return rotate_pairs(xq, freqs_cis, 2), rotate_pairs(xk, freqs_cis, 2)


@contextlib.contextmanager
def real_rotation_while_tracing(model: torch.nn.Module) -> Iterator[None]:
    """The family's complex `apply_rotary_emb` (Llama 4's) replaced by the real one while the model runs."""
    family = sys.modules[type(model).__module__]
    original = getattr(family, "apply_rotary_emb", None)
    if original is None or "view_as_complex" not in original.__code__.co_names:
        yield
        return
    family.apply_rotary_emb = _apply_rotary_emb  # type: ignore[attr-defined]
    try:
        yield
    finally:
        family.apply_rotary_emb = original  # type: ignore[attr-defined]
