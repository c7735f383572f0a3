"""DeepSeek-V3.2's sparse attention (DSA) as the export writes it: the latent attention (latent_attention.py) over
the tokens its lightning indexer chooses.

The indexer scores every cached token for each query with a few small heads of its own,

    index[s, t] = Σ_h  w[s, h] · relu(q_h[s] · k[t]) · 1/sqrt(index_head_dim)      (w = weights_proj(x) / sqrt(H))

and attention sees only the `index_topk` best tokens of each query: the k-th best score (TopK) is a threshold, and
the scores below it get the dtype's minimum as a bias (standard ops; tokens tied with the k-th are all kept, where
transformers keeps k of them). Its key `k` (index_head_dim wide, one per token) is cached beside the rotary key: the
layer's value tensor holds [k_rot | k], so the cache keeps its two tensors a layer, updated in place as every
static cache is. A query with fewer valid tokens than `index_topk` keeps them all (the masked slots TopK picks
stay masked), as transformers does.

Attention itself still reads every slot under the mask; at a decode step a gather of the chosen tokens' latents
would read `index_topk` of them instead (not written: equal below 2,048 tokens of context).
"""

from __future__ import annotations

import sys
from typing import Protocol, cast

import torch

# the rotary embedding's (cos, sin)
PositionEmbeddings = tuple[torch.Tensor, torch.Tensor]


class Indexer(Protocol):
    """What the export reads of a DeepSeek-V3.2 indexer module (transformers' DeepseekV32Indexer)."""

    n_heads: int
    head_dim: int
    qk_rope_head_dim: int
    index_topk: int
    softmax_scale: float
    wq_b: torch.nn.Module
    wk: torch.nn.Module
    k_norm: torch.nn.Module
    weights_proj: torch.nn.Module


def index_projections(
    indexer: Indexer, hidden_states: torch.Tensor, query_latent: torch.Tensor, position_embeddings: PositionEmbeddings
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries [batch, sequence, heads, index_head_dim] and the new tokens' keys [batch, 1, sequence,
    index_head_dim], their rotary parts rotated by the family's rotate-half rotation (the attention's interleaves).
    `query_latent` is the attention's q_a_layernorm(q_a_proj(x))."""
    batch, sequence = hidden_states.shape[:-1]
    queries = indexer.wq_b(query_latent).view(batch, sequence, indexer.n_heads, indexer.head_dim)
    keys = indexer.k_norm(indexer.wk(hidden_states)).view(batch, sequence, 1, indexer.head_dim)
    parts = [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim]
    (q_rot, q_pass), (k_rot, k_pass) = torch.split(queries, parts, dim=-1), torch.split(keys, parts, dim=-1)
    rotate = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings, unsqueeze_dim=2)
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1).transpose(1, 2)


def index_bias(
    indexer: Indexer, hidden_states: torch.Tensor, queries: torch.Tensor, cached_keys: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[batch, 1, sequence, cache], added to the attention's scores: 0 at the tokens the indexer chose, the dtype's
    minimum elsewhere. From its `queries` (index_projections), `cached_keys` [batch, 1, cache, index_head_dim] and
    the attention's additive `mask` (the same tensor: passes/static_cache.py rewrites both reads of it)."""
    scores = torch.relu(torch.matmul(queries, cached_keys.transpose(2, 3)) * indexer.softmax_scale)  # [b, s, h, t]
    weights = indexer.weights_proj(hidden_states) * indexer.n_heads**-0.5  # [batch, sequence, heads]
    index = torch.matmul(weights.unsqueeze(-2), scores).transpose(1, 2) + mask  # [batch, 1, sequence, cache]
    # the k-th best score, k a constant: the scores are padded with k of -inf, so that fewer tokens than k keep all
    # (no k from the cache's length, which the static cache's layout changes: passes/static_cache.py)
    batch, sequence = hidden_states.shape[:-1]
    floor = torch.full((1, 1, 1, indexer.index_topk), float("-inf")).expand(batch, 1, sequence, -1)
    kth = torch.cat((index, floor), dim=-1).topk(indexer.index_topk, dim=-1).values[..., -1:]
    return torch.zeros_like(index).masked_fill(index < kth, torch.finfo(index.dtype).min)


def additive(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """The attention mask over `length` slots as additive (0 visible, the dtype's minimum hidden)."""
    mask = attention_mask[:, :, :, :length]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)


def indexer_of(attention: object) -> Indexer | None:
    """The attention module's indexer (DeepSeek-V3.2's), or None."""
    indexer = getattr(attention, "indexer", None)
    return cast("Indexer", indexer) if isinstance(indexer, torch.nn.Module) else None
