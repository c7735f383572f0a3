"""A transformer block whose feed-forward is a top-2 mixture of experts with a gating network.

Routing is written densely (every expert runs; a top-2 mask weights their outputs), which is how MoE blocks
export to static ONNX graphs that TensorRT and ONNX Runtime can run with dynamic batch and sequence.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 64
HEADS = 4
EXPERTS = 4
TOP_K = 2
FFN = 128


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class TopTwoMixture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self.gate(x), dim=-1)
        top_values, top_indices = torch.topk(probabilities, TOP_K, dim=-1)
        top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        # [batch, sequence, experts]: the renormalised gate weight of each chosen expert, 0 for the others.
        weights = torch.zeros_like(probabilities).scatter(-1, top_indices, top_values)
        expert_outputs = torch.stack([expert(x) for expert in self.experts], dim=-1)
        return (expert_outputs * weights.unsqueeze(-2)).sum(dim=-1)


class MoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.attention_norm = nn.LayerNorm(HIDDEN)
        self.mixture = TopTwoMixture()
        self.mixture_norm = nn.LayerNorm(HIDDEN)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attention(hidden_states, hidden_states, hidden_states, need_weights=False)
        x = self.attention_norm(hidden_states + attended)
        return self.mixture_norm(x + self.mixture(x))


def build() -> MoeBlock:
    """Seeded weights: the sample needs no checkpoint."""
    torch.manual_seed(0)
    return MoeBlock().eval()
