"""A decoder's variants measured as language models: perplexity on held-out text (`--eval-data` as a .txt file,
tokenized with the checkpoint's tokenizer, or an .npz of `input_ids`), against the fp32 graph."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.variants.text_data import (
    evaluation_windows,
    is_decoder_graph,
    prefill_feeds,
    token_windows,
    window_length,
)
from tensorsmith.core.language import TokenFigures
from tensorsmith.runtime.manifest import TensorRecord, VariantRecord


@dataclass(frozen=True)
class TextEvaluation:
    tokens: np.ndarray  # [rows, window]
    feeds: dict[str, np.ndarray]  # a prefill of `tokens` with an empty cache
    described: str


def text_evaluation(config: CompileConfig, inputs: list[TensorRecord], reference: Path) -> TextEvaluation | None:
    """The evaluation text of a decoder compile, None when there is none (or the model is no decoder); as many
    windows as the `reference` graph's vocabulary allows (text_data.evaluation_windows)."""
    if not is_decoder_graph(inputs) or config.evaluation is None:
        return None
    path = config.resolve(config.evaluation)
    length = window_length(config)
    tokens = token_windows(config, path, length, evaluation_windows(reference, length))
    rows, width = tokens.shape
    return TextEvaluation(tokens, prefill_feeds(tokens, inputs), f"{rows} windows of {width} tokens of {path.name}")


def with_language_metrics(
    record: VariantRecord, evaluation: TextEvaluation, reference: TokenFigures, actual: TokenFigures
) -> VariantRecord:
    """`record` with perplexity, perplexity-ratio and next-token-agreement on the evaluation text added: its
    `actual` figures against the fp32 graph's `reference` (each measure.token_figures)."""
    where = f"{record.evaluated_on}; language-model metrics on {evaluation.described}"
    accuracy = {**record.accuracy, **actual.metrics(reference)}
    return record.model_copy(update={"accuracy": accuracy, "evaluated_on": where})
