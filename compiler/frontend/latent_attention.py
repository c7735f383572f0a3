"""Multi-head latent attention (DeepSeek-V2/V3's MLA) as the export writes it.

transformers caches MLA's compressed form (the normalised latent c_kv, kv_lora_rank wide, as the key; the rotary
key k_rot, qk_rope wide, as the value; one head each) but decompresses the whole cache through `kv_b_proj` at
every step: at 1,024 tokens of context and DeepSeek-V2-Lite's shape that is 2 GFLOP a layer per decoded token.
The export swaps each MLA module's forward for the absorbed form of the DeepSeek-V2 paper (§2.1.2): W_UK (the key
half of `kv_b_proj`) multiplies the query into latent space and W_UV (its value half) the attention's output, so
attention runs over the cache as it is stored:

    scores = (q_nope · W_UK) · c_kvᵀ + q_rot · k_rotᵀ        (× 1/sqrt(qk_nope + qk_rope), the module's scaling)
    out    = (softmax(scores + mask) · c_kv) · W_UVᵀ         → o_proj

Each head's query reads the one latent head: no key or value is repeated. `mla_cache="full"` instead caches every
head's decompressed keys (qk_nope + qk_rope) and values (v_head_dim), as NVIDIA's TensorRT-Model-Connect does,
for comparison. DeepSeek-V2's rotary embedding is complex-valued (torch.polar), which no exporter takes: it is
rotated in real arithmetic (complex_rotary.py).

A module is recognised by what it holds (`kv_a_proj_with_mqa`, `kv_b_proj`, `kv_lora_rank`), not by its family.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, NamedTuple

import torch

from tensorsmith.compiler.frontend.complex_rotary import PairAngles, rewrite_complex_rotary, rotate_pairs
from tensorsmith.compiler.frontend.indexed_attention import additive, index_bias, index_projections, indexer_of
from tensorsmith.compiler.frontend.module_protocols import LatentAttention
from tensorsmith.core.errors import ConfigError, ExportError

if TYPE_CHECKING:
    from transformers import Cache

    from tensorsmith.compiler.frontend.config_json import ConfigJson

# the rotary embedding's (cos, sin), or its PairAngles (DeepSeek-V2's complex rotation: complex_rotary.py)
PositionEmbeddings = tuple[torch.Tensor, torch.Tensor]

# the parts of an MLA module the forwards below compute; a module with others is refused
KNOWN_PARTS = frozenset(
    {"q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}
)
INDEXED_PARTS = KNOWN_PARTS | {"indexer"}  # DeepSeek-V3.2's (indexed_attention.py), with the latent cache only


def latent_cache_widths(config: ConfigJson, mla_cache: str) -> tuple[int, int, int, str]:
    """An MLA decoder's cache per layer from config.json: (kv heads, key width, value width, cache form). The latent
    cache holds one head: the normalised latent as the key, the rotary key as the value (DeepSeek-V3.2's indexer key
    after it); `mla_cache="full"` every head's keys (qk_nope + qk_rope) and values (v_head_dim)."""
    indexed = "indexed_attention" in (config.get("layer_types") or [])  # DeepSeek-V3.2's (indexed_attention.py)
    rotary, latent = int(config["qk_rope_head_dim"]), int(config.get("kv_lora_rank") or 0)
    if mla_cache == "full":
        if indexed:
            raise ConfigError(
                f"--mla-cache full: {config.get('model_type')}'s indexer keys have no place in the decompressed cache",
                hint="compile its latent cache (the default, --mla-cache latent)",
            )
        heads = int(config["num_attention_heads"])
        return heads, int(config["qk_nope_head_dim"]) + rotary, int(config["v_head_dim"]), "per_head"
    if indexed:  # the indexer's key cached beside the rotary key: the value [k_rot | index key]
        return 1, latent, rotary + int(config["index_head_dim"]), "latent_indexed"
    return 1, latent, rotary, "latent"


def is_latent_attention(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_lora_rank"))


def rewrite_latent_attention(model: torch.nn.Module, mla_cache: str = "latent") -> int:
    """Swap every MLA module's forward in `model` (in place) for the `mla_cache` form; returns how many."""
    latent = [module for module in model.modules() if is_latent_attention(module)]
    for module in latent:
        known = INDEXED_PARTS if mla_cache == "latent" else KNOWN_PARTS
        unknown = sorted(name for name, _ in module.named_children() if name not in known)
        if unknown:  # a part computed nowhere below would be dropped silently
            raise ExportError(
                f"{type(module).__name__} holds {', '.join(unknown)}, which the latent attention's "
                "export does not compute",
                hint="this attention is not supported yet",
            )
    forward = _absorbed_forward if mla_cache == "latent" else _full_forward
    for module in latent:
        module.forward = types.MethodType(forward, module)
    if latent:  # the rotation these forwards apply in real arithmetic (DeepSeek-V2's)
        rewrite_complex_rotary(model)
    return len(latent)


def _rotate(
    self: LatentAttention, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings: PositionEmbeddings
) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's own rotation of the query's and key's rotary parts."""
    if isinstance(position_embeddings, PairAngles):  # adjacent pairs as complex numbers (DeepSeek-V2)
        return rotate_pairs(q_rot, position_embeddings, 1), rotate_pairs(k_rot, position_embeddings, 1)
    family = sys.modules[type(self).__module__]
    cos, sin = position_embeddings
    # DeepSeek-V3's config says whether its pairs interleave; where it does not, a family with the interleaved form
    # uses it (LongCat-Flash's and DeepSeek-V3.2's attention; V3.2's rotate-half form is its indexer's)
    if getattr(self.config, "rope_interleave", hasattr(family, "apply_rotary_pos_emb_interleave")):
        rotated: tuple[torch.Tensor, torch.Tensor] = family.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    else:
        rotated = family.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    return rotated


class Projected(NamedTuple):
    """An MLA module's projections of the new tokens."""

    q_nope: torch.Tensor  # [batch, heads, sequence, qk_nope]
    q_rot: torch.Tensor  # [batch, heads, sequence, qk_rope], rotated
    latent: torch.Tensor  # [batch, 1, sequence, kv_lora_rank]
    k_rot: torch.Tensor  # [batch, 1, sequence, qk_rope], rotated
    query_latent: torch.Tensor | None  # q_a_layernorm(q_a_proj(x)), where the query has a LoRA (the indexer's input)


def _projections(
    self: LatentAttention, hidden_states: torch.Tensor, position_embeddings: PositionEmbeddings
) -> Projected:
    batch, sequence = hidden_states.shape[:-1]
    query_latent = None
    if getattr(self, "q_lora_rank", None) is None:
        query = self.q_proj(hidden_states)
    else:
        query_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))
        query = self.q_b_proj(query_latent)
    query = query.view(batch, sequence, -1, self.qk_head_dim).transpose(1, 2)
    q_nope, q_rot = torch.split(query, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    latent, k_rot = torch.split(
        self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
    )
    latent = self.kv_a_layernorm(latent).view(batch, 1, sequence, self.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, sequence, self.qk_rope_head_dim)
    # LongCat-Flash scales the query and the latent by the LoRA ranks' ratios to the hidden size (the rotary key not)
    query_scale, latent_scale = getattr(self, "mla_scale_q_lora", 1.0), getattr(self, "mla_scale_kv_lora", 1.0)
    q_nope, q_rot, latent = q_nope * query_scale, q_rot * query_scale, latent * latent_scale
    q_rot, k_rot = _rotate(self, q_rot, k_rot, position_embeddings)
    return Projected(q_nope, q_rot, latent, k_rot, query_latent)


def _masked_softmax(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : scores.shape[-1]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def _absorbed_forward(
    self: LatentAttention,
    hidden_states: torch.Tensor,
    position_embeddings: PositionEmbeddings,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    batch, sequence = hidden_states.shape[:-1]
    q_nope, q_rot, latent, k_rot, query_latent = _projections(self, hidden_states, position_embeddings)
    indexer = indexer_of(self)
    if indexer is not None:  # DeepSeek-V3.2: the indexer's keys cached beside the rotary key (indexed_attention.py)
        assert query_latent is not None, "DeepSeek-V3.2's attention has a query LoRA"
        index_queries, index_keys = index_projections(indexer, hidden_states, query_latent, position_embeddings)
        k_rot = torch.cat((k_rot, index_keys), dim=-1)
    if cache is not None:
        latent, k_rot = cache.update(latent, k_rot, self.layer_idx)
    indexed = None  # the indexer's bias and the additive mask, sliced (one tensor: the indexer's and the scores')
    if indexer is not None:
        k_rot, index_keys = torch.split(k_rot, [self.qk_rope_head_dim, indexer.head_dim], dim=-1)
        assert attention_mask is not None, "a causal decoder's attention has a mask"
        mask = additive(attention_mask, latent.shape[2])
        indexed = index_bias(indexer, hidden_states, index_queries, index_keys, mask), mask
    # kv_b_proj's weight [heads × (qk_nope + v), kv_lora_rank] split per head into W_UK and W_UV
    weight = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
    w_uk, w_uv = torch.split(weight, [self.qk_nope_head_dim, self.v_head_dim], dim=1)
    q_latent = torch.matmul(q_nope, w_uk)  # [batch, heads, sequence, kv_lora_rank]
    scores = torch.matmul(q_latent, latent.transpose(2, 3)) + torch.matmul(q_rot, k_rot.transpose(2, 3))
    if indexed is None:
        probabilities = _masked_softmax(scores * self.scaling, attention_mask)
    else:  # the mask added last: Softmax(Add(x, mask)), as passes/static_cache.py finds it
        bias, mask = indexed
        probabilities = torch.softmax(scores * self.scaling + bias + mask, dim=-1, dtype=torch.float32)
    out = torch.matmul(torch.matmul(probabilities, latent), w_uv.transpose(1, 2))  # [batch, heads, sequence, v]
    return self.o_proj(out.transpose(1, 2).reshape(batch, sequence, -1)), None


def _full_forward(
    self: LatentAttention,
    hidden_states: torch.Tensor,
    position_embeddings: PositionEmbeddings,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    batch, sequence = hidden_states.shape[:-1]
    q_nope, q_rot, latent, k_rot, _ = _projections(self, hidden_states, position_embeddings)
    decompressed = self.kv_b_proj(latent[:, 0]).view(batch, sequence, self.num_heads, -1).transpose(1, 2)
    k_nope, values = torch.split(decompressed, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
    if cache is not None:
        keys, values = cache.update(keys, values, self.layer_idx)
    scores = torch.matmul(torch.cat((q_nope, q_rot), dim=-1), keys.transpose(2, 3))
    probabilities = _masked_softmax(scores * self.scaling, attention_mask)
    out = torch.matmul(probabilities, values)
    return self.o_proj(out.transpose(1, 2).reshape(batch, sequence, -1)), None
