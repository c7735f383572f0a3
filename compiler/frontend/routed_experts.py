"""Sparse mixture-of-experts layers exported so that a token computes only the experts its router chose.

transformers 5 computes a family's stacked experts (`gate_up_proj [experts, 2 × intermediate, hidden]`,
`down_proj [experts, hidden, intermediate]`) with a kernel named by `experts_implementation`. Its default,
grouped_mm, has no ONNX form; batched_mm gathers each (token, chosen expert) pair's weights and multiplies them
one pair at a time, which is right for a decode step (k experts' weights read) and impossible for a prompt (at
DeepSeek-V2-Lite's shape a 128-token prefill would gather 768 copies of 35 MB of weights a layer). The kernel
registered here chooses by the number of pairs, in the graph (torch.cond, ONNX If):

- up to GATHERED_PAIRS pairs (decode, small batches): batched_mm's gather, over the [experts, in, out] layout
  both branches read;
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
    # both branches read the stacked weights as [experts, in, out], one transposed copy the export folds outside
    # the If (each branch's copy of it written once: core/branch_copies.py): a token's row times the matrix reads
    # it along rows, 1.6x faster than [out, in] times the column on ONNX Runtime's CPU (64 experts of 2816 × 2048,
    # one token: 57 ms against 92)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up, down = (up, self.down_proj) if self.is_transposed else (up.transpose(1, 2), self.down_proj.transpose(1, 2))

    def gathered(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return _gathered(self, hidden, index, weights, up, down)

    def every_expert(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return _every_expert(self, hidden, index, weights, up, down)

    if not torch.compiler.is_exporting():  # eager runs (the reference): the branch the graph would take
        chosen = gathered if top_k_index.numel() <= GATHERED_PAIRS else every_expert
        return chosen(hidden_states, top_k_index, top_k_weights)
    return torch.cond(
        top_k_index.numel() <= GATHERED_PAIRS, gathered, every_expert, (hidden_states, top_k_index, top_k_weights)
    )


def _gathered(
    self: StackedExperts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """transformers' batched_mm over [experts, in, out] weights: each (token, chosen expert) pair's weights
    gathered and multiplied, the pairs' outputs weighted by the router and summed per token."""
    tokens, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)  # [pairs]
    pairs = hidden_states.repeat_interleave(top_k, dim=0).unsqueeze(1)  # [pairs, 1, hidden]
    projected = _through_experts(self, pairs, up[experts], down[experts], lambda bias: bias[experts].unsqueeze(1))
    weighted = projected.squeeze(1) * top_k_weights.reshape(-1).unsqueeze(-1)  # [pairs, hidden]
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _every_expert(
    self: StackedExperts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Every expert over every token as one batched product per projection, each output weighted by the router
    (0 where the token did not choose the expert) and summed: weights read once, no shape depends on the routing."""
    experts = torch.arange(self.num_experts, device=hidden_states.device)
    chose = (top_k_index.unsqueeze(-1) == experts).float()  # [tokens, k, experts]; no scatter: TensorRT has no add
    routing = (chose * top_k_weights.float().unsqueeze(-1)).sum(dim=1)  # [tokens, experts]
    projected = _through_experts(self, hidden_states.unsqueeze(0), up, down, lambda bias: bias.unsqueeze(1))
    weighted = projected.float() * routing.transpose(0, 1).unsqueeze(-1)
    return weighted.sum(dim=0).to(hidden_states.dtype)


def _through_experts(
    self: StackedExperts,
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    biases: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x [n, rows, hidden] through n experts' [in, out] weights `up` and `down` (each expert's MLP, as the
    family's own kernels compute it) → [n, rows, hidden]; `biases` shapes a stacked bias [experts, out] to add."""
    projected = x @ up
    if self.has_bias:
        projected = projected + biases(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)
    projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    projected = projected @ down
    if self.has_bias:
        projected = projected + biases(self.down_proj_bias)
    if self.has_post_expert_norm:
        projected = self.post_expert_norm(projected)
    return projected


def register_routed_experts() -> str:
    """The kernel in transformers' experts table (idempotent); its name, for `experts_implementation`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, routed_experts_forward)
    return EXPERTS_IMPLEMENTATION
