"""Sparse mixture-of-experts layers exported so that a token computes only the experts its router chose.

transformers 5 computes a family's stacked experts (`gate_up_proj [experts, 2 × intermediate, hidden]`,
`down_proj [experts, hidden, intermediate]`) with a kernel named by `experts_implementation`. Its default,
grouped_mm, has no ONNX form; batched_mm gathers each (token, chosen expert) pair's weights and multiplies them
one pair at a time, which is right for a decode step (k experts' weights read) and impossible for a prompt (at
DeepSeek-V2-Lite's shape a 128-token prefill would gather 768 copies of 35 MB of weights a layer). The kernel
registered here chooses by the number of pairs, in the graph (torch.cond, ONNX If):

- up to GATHERED_PAIRS pairs (decode, small batches): batched_mm's gather;
- more (prefill): every expert over every token in one batched product per projection, each output weighted by
  the router (0 for an expert the token did not choose): every expert's weights read once, and E/k times the
  routed FLOPs. The sparse form (each expert over the tokens routed to it: NonZero, Gather, ScatterElements) runs
  on ONNX Runtime but does not build with TensorRT for RTX 1.7 ("NonZero plugin creator version 1 was not found"),
  whose graph is the same.

A decode step computes only the chosen experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

EXPERTS_IMPLEMENTATION = "tensorsmith_routed"
GATHERED_PAIRS = 64  # (token, expert) pairs up to which the chosen experts' weights are gathered per pair

if TYPE_CHECKING:

    class StackedExperts(torch.nn.Module):
        """What the kernels read of a family's experts module. The families' classes share no base class but
        nn.Module (transformers' `use_experts_implementation` decorates each), which its own kernels take."""

        num_experts: int
        has_gate: bool  # gate_up_proj (gate and up fused), else up_proj
        has_bias: bool
        has_post_expert_norm: bool
        is_transposed: bool  # weights [experts, in, out], else [experts, out, in]
        gate_up_proj: torch.Tensor
        up_proj: torch.Tensor
        down_proj: torch.Tensor
        gate_up_proj_bias: torch.Tensor
        up_proj_bias: torch.Tensor
        down_proj_bias: torch.Tensor
        act_fn: Callable[[torch.Tensor], torch.Tensor]
        post_expert_norm: torch.nn.Module

        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def routed_experts_forward(
    self: StackedExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    from transformers.integrations.moe import batched_mm_experts_forward

    def gathered(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return batched_mm_experts_forward(self, hidden, index, weights)

    def every_expert(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return _every_expert(self, hidden, index, weights)

    if not torch.compiler.is_exporting():  # eager runs (the reference): the branch the graph would take
        chosen = gathered if top_k_index.numel() <= GATHERED_PAIRS else every_expert
        return chosen(hidden_states, top_k_index, top_k_weights)
    return torch.cond(
        top_k_index.numel() <= GATHERED_PAIRS, gathered, every_expert, (hidden_states, top_k_index, top_k_weights)
    )


def _every_expert(
    self: StackedExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Every expert over every token as one batched product per projection, each output weighted by the router
    (0 where the token did not choose the expert) and summed: weights read once, no shape depends on the routing."""
    experts = torch.arange(self.num_experts, device=hidden_states.device)
    chose = (top_k_index.unsqueeze(-1) == experts).float()  # [tokens, k, experts]; no scatter: TensorRT has no add
    routing = (chose * top_k_weights.float().unsqueeze(-1)).sum(dim=1)  # [tokens, experts]
    gate_up = self.gate_up_proj if self.has_gate else self.up_proj  # [experts, out, in] (or [experts, in, out])
    projected = _linear(hidden_states.unsqueeze(0), gate_up, self.is_transposed)  # [experts, tokens, out]
    if self.has_bias:
        projected = projected + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias).unsqueeze(1)
    projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    projected = _linear(projected, self.down_proj, self.is_transposed)  # [experts, tokens, hidden]
    if self.has_bias:
        projected = projected + self.down_proj_bias.unsqueeze(1)
    if self.has_post_expert_norm:
        projected = self.post_expert_norm(projected)
    weighted = projected.float() * routing.transpose(0, 1).unsqueeze(-1)
    return weighted.sum(dim=0).to(hidden_states.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """x [experts or 1, tokens, in] through the stacked `weight` → [experts, tokens, out]. A weight stored
    [experts, out, in] is read as it is (W @ xᵀ, as batched_mm's gather reads it), never transposed: a transposed
    weight would be folded into a second copy of every expert, where the branches' equal copies are written once
    (core/branch_copies.py)."""
    return x @ weight if is_transposed else (weight @ x.transpose(-1, -2)).transpose(-1, -2)


def register_routed_experts() -> str:
    """The kernel in transformers' experts table (idempotent); its name, for `experts_implementation`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, routed_experts_forward)
    return EXPERTS_IMPLEMENTATION
