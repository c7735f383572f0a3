"""A decoder's variants measured as language models: perplexity on held-out text (`--eval-data` as a .txt file,
tokenized with the checkpoint's tokenizer, or an .npz of `input_ids`), against the fp32 graph."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.language import language_model_metrics
from tensorsmith.core.sessions import run_onnx
from tensorsmith.runtime.manifest import TensorRecord, VariantRecord

WINDOW = 128  # tokens per evaluation row (at most the decoder's max sequence length)
ROWS = 8


@dataclass(frozen=True)
class TextEvaluation:
    tokens: np.ndarray  # [rows, window]
    feeds: dict[str, np.ndarray]  # a prefill of `tokens` with an empty cache
    described: str


def text_evaluation(config: CompileConfig, inputs: list[TensorRecord]) -> TextEvaluation | None:
    """The evaluation text of a decoder compile, None when there is none (or the model is no decoder)."""
    pasts = [record for record in inputs if record.name.startswith("past_key_values.")]
    if not pasts or config.evaluation is None:
        return None
    path = config.resolve(config.evaluation)
    length = min(WINDOW, (config.dims["total"].max if "total" in config.dims else None) or WINDOW)
    if path.suffix == ".txt":
        from tokenizers import Tokenizer

        vocabulary = config.resolve(config.source) / "tokenizer.json"
        if not vocabulary.is_file():
            raise ConfigError(f"{path} is text, and {config.source} has no tokenizer.json to read it with",
                              hint="pass an .npz of input_ids instead")  # fmt: skip
        ids = Tokenizer.from_file(str(vocabulary)).encode(path.read_text()).ids
        rows = min(ROWS, len(ids) // length)
        if rows == 0:
            raise ConfigError(f"{path} has {len(ids)} tokens, fewer than one window of {length}", hint="add text")
        tokens = np.array([ids[i * length : (i + 1) * length] for i in range(rows)], np.int64)
    else:
        with np.load(path) as archive:
            if "input_ids" not in archive.files:
                raise ConfigError(f"{path} has no array 'input_ids'", hint="save token ids as input_ids [rows, length]")
            tokens = np.asarray(archive["input_ids"][:ROWS, :length], np.int64)
    rows, width = tokens.shape
    feeds = {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
             "position_ids": np.broadcast_to(np.arange(width), tokens.shape).copy()}  # fmt: skip
    for record in pasts:
        kv_heads, head_dim = record.shape[1], record.shape[3]
        assert isinstance(kv_heads, int) and isinstance(head_dim, int)
        feeds[record.name] = np.zeros((rows, kv_heads, 0, head_dim), np.float32)
    return TextEvaluation(tokens, feeds, f"{rows} windows of {width} tokens of {path.name}")


def with_language_metrics(
    record: VariantRecord, reference: Path, directory: Path, evaluation: TextEvaluation
) -> VariantRecord:
    """`record` with perplexity, perplexity-ratio and next-token-agreement on the evaluation text added."""
    expected = run_onnx(reference, evaluation.feeds)[0]
    actual = run_onnx(directory / record.path, evaluation.feeds)[0]
    measured = language_model_metrics(evaluation.tokens, expected, actual)
    where = f"{record.evaluated_on}; language-model metrics on {evaluation.described}"
    return record.model_copy(update={"accuracy": {**record.accuracy, **measured}, "evaluated_on": where})
