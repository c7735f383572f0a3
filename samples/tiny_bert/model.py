"""A small BERT-style encoder written in code: embeddings, multi-head attention, LayerNorm, GELU."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

VOCAB_SIZE = 1000
HIDDEN = 64
HEADS = 4
LAYERS = 2
FFN = 256
MAX_POSITIONS = 128


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.output = nn.Linear(HIDDEN, HIDDEN)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        return x.view(batch, sequence, HEADS, HIDDEN // HEADS).transpose(1, 2)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HIDDEN // HEADS) + additive_mask
        context = torch.softmax(scores, dim=-1) @ v
        batch, _, sequence, _ = context.shape
        return self.output(context.transpose(1, 2).reshape(batch, sequence, HIDDEN))


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = SelfAttention()
        self.attention_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.intermediate = nn.Linear(HIDDEN, FFN)
        self.output = nn.Linear(FFN, HIDDEN)
        self.output_norm = nn.LayerNorm(HIDDEN, eps=1e-12)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, additive_mask))
        return self.output_norm(x + self.output(nn.functional.gelu(self.intermediate(x))))


class TinyBert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.embedding_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(LAYERS))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.embedding_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        # [batch, 1, 1, sequence]: 0 where attended, a large negative number where padded.
        additive_mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, additive_mask)
        return x


def build() -> TinyBert:
    """The factory named in tensorsmith.toml; weights come from the checkpoint."""
    return TinyBert()


def write_weights(path: Path, seed: int = 0) -> Path:
    """Seeded weights, saved with safetensors (what `compile --checkpoint` loads)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = TinyBert()
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(path))
    return path
