"""The gated delta rule (Gated DeltaNet's recurrence) in standard ops, chunk by chunk, as an ONNX Scan.

Per token t, with the state S [key_dim, value_dim] of a head:

    S = S · exp(g_t);  S += k_t ⊗ β_t (v_t - Sᵀk_t);  o_t = Sᵀq_t

Token by token, a 1,024-token prompt is 1,024 sequential steps of a layer. The chunked form (the one
transformers' `torch_chunk_gated_delta_rule` and the FLA kernels compute) takes C tokens a step: within a chunk,
with G the cumulative sum of g and D[i, j] = exp(G_i - G_j) for j ≤ i,

    L = strictly_lower(diag(β) K Kᵀ ⊙ D),   T = (I + L)⁻¹
    U = T (diag(β) V),   W = T (diag(β exp(G)) K)             (the WY form: the chunk's updates as one product)
    V' = U - W S,   O = (Q ⊙ exp(G)) S + (Q Kᵀ ⊙ D ⊙ causal) V'
    S = S · exp(G_C) + (K ⊙ exp(G_C - G))ᵀ V'

T is found without a loop over rows: L is nilpotent (strictly lower, C × C), so (I + L)⁻¹ = Σ (-L)^k =
(I - L)(I + L²)(I + L⁴)…(I + L^{C/2}), six matrix products for C = 64. The chunk is min(sequence, 64) tokens:
a decode step is one chunk of one token, a prompt of 20 one chunk of 20, a prompt of 1,024 sixteen chunks of 64
(the last padded with zeros, which leave the state as it is: k = 0, g = 0). Every chunk's work is in the Scan's
body, so the fp16 variant keeps all of it in fp32 (passes/half_regions.py keeps Scan) as transformers does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

CHUNK = 64
POWERS = 6  # (I + L)⁻¹ as the product of (I - L) and (I + L^(2^i)) for i < POWERS: exact for chunks up to 2^6


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over [b, s, heads, d] inputs (keys' heads repeated to the values'; q and k normalised here, q
    scaled by 1/sqrt(key_dim)), in float32 as transformers computes it: (outputs [b, s, value_heads, dv], the
    final state [b, value_heads, dk, dv])."""
    repeat = v.shape[2] // q.shape[2]
    q, k = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (q, k))
    q, k = (t.float() * torch.rsqrt((t.float() * t.float()).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / (q.shape[-1] ** 0.5)
    batch, length, heads, key_dim = q.shape
    chunk = torch.sym_min(length, CHUNK)
    padding = (chunk - length % chunk) % chunk
    packed = torch.cat([q, k, v.float(), g.float()[..., None], beta.float()[..., None]], dim=-1)
    packed = F.pad(packed, (0, 0, 0, 0, 0, padding))  # zeros after the last token
    chunks = packed.reshape(batch, -1, chunk, heads, packed.shape[-1]).permute(1, 0, 3, 2, 4)  # [n, b, h, C, *]
    step = functools.partial(_chunk_step, key_dim, int(v.shape[-1]))
    # inference only: inputs that require grad (the weights' products) send the trace through scan's autograd
    # form, whose joint graph returns the batch size among its outputs and fails the export
    final, outputs = scan(step, state.float().detach(), [chunks.detach()])
    outputs = outputs.permute(1, 0, 3, 2, 4).reshape(batch, -1, heads, outputs.shape[-1])  # [b, n·C, h, dv]
    return outputs[:, :length], final


def _chunk_step(
    key_dim: int, value_dim: int, state: torch.Tensor, chunk: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: state [b, h, dk, dv]; the chunk's q, k [b, h, C, dk], v [b, h, C, dv], g, β [b, h, C, 1]
    packed in one tensor (one scanned input: TensorRT for RTX's Myelin mis-shapes a model's several). Its masks
    are made here, from the chunk's length: the body reads nothing from the graph outside it, which the fp16
    variant converts."""
    packed = chunk[0]
    positions = torch.arange(packed.shape[-2], device=packed.device)
    causal = (positions[None, :] <= positions[:, None]).float()  # [C, C]: j ≤ i
    q, k = packed[..., :key_dim], packed[..., key_dim : 2 * key_dim]
    v = packed[..., 2 * key_dim : 2 * key_dim + value_dim]
    g, beta = packed[..., -2].cumsum(-1), packed[..., -1:]  # g: [b, h, C], summed over the chunk
    decay = torch.where(causal > 0, g[..., :, None] - g[..., None, :], 0.0).exp() * causal  # D
    k_beta = k * beta
    lower = (k_beta @ k.transpose(-1, -2)) * decay * (1 - torch.eye(causal.shape[0], device=causal.device))
    inverse = _unit_lower_inverse(lower)  # T = (I + L)⁻¹
    values = inverse @ (v * beta)  # U
    weights = inverse @ (k_beta * g.exp()[..., None])  # W
    new = values - weights @ state  # V'
    out = (q * g.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ new
    last = g[..., -1:]
    state = state * last.exp()[..., None] + (k * (last - g).exp()[..., None]).transpose(-1, -2) @ new
    return state.clone(), out


def _unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ for strictly lower-triangular L (nilpotent: L^C = 0) as (I - L)(I + L²)(I + L⁴)…"""
    identity = torch.eye(lower.shape[-1], device=lower.device)
    inverse, power = identity - lower, lower
    for _ in range(1, POWERS):
        power = power @ power
        inverse = inverse @ (identity + power)
    return inverse
