"""A decoder's calibration and evaluation data from text: a .txt file tokenized with the checkpoint's tokenizer
(or an .npz of `input_ids`), cut into windows of tokens.

Calibration feeds cover both graphs generation runs: the prefill of a window with an empty cache, and decode
steps, one token over the cache of the tokens before it. The cache comes from one fp32 prefill of the window:
attention is causal, so its first p positions are exactly the cache of the first p tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from tensorsmith.calibration import CalibrationData
from tensorsmith.calibration.data import Feeds
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.sessions import Session, open_session, run_remembered, session_over
from tensorsmith.runtime.manifest import TensorRecord

if TYPE_CHECKING:
    from tokenizers import Tokenizer

WINDOW = 128  # tokens per window (at most the decoder's max sequence length)
EVALUATION_WINDOWS = 64  # 8 left AWQ and RTN apart by less than the noise (measured on tinylm)
CALIBRATION_WINDOWS = 64  # without --calibration-samples
# a calibration batch's returned activations, at most (without --calibration-batch-size): 256 MB took the 135M INT4
# compile to 2.13 GB at AWQ's statistics pass, 128 MB to 1.96 (the whole compile 2.01 GB; 100 s against 104)
OBSERVED_BYTES = 128 << 20
# the evaluation's logits, at most: the reference's and a variant's are held at once, with ONNX Runtime's own copy
# (64 windows of 128 tokens at SmolLM-135M's vocabulary: 1.6 GB each, a 7.4 GB peak; at Llama-3.2-1B's, 4.2 GB)
EVALUATED_BYTES = 512 << 20
MIN_EVALUATION_WINDOWS = 8
DECODE_POINTS = (0.25, 0.5, 1.0)  # past lengths of the decode steps calibrated, as fractions of a window
PAST_PREFIX = "past_key_values."
CHARACTERS_PER_TOKEN = 16  # a prefix this long per token needed holds enough tokens for any BPE on prose or code
BOUNDARY_TOKENS = 64
DECODE_TIMING_ROWS = 8  # the decode step the cpu recipe is timed on


def is_decoder_graph(inputs: list[TensorRecord]) -> bool:
    return any(record.name.startswith(PAST_PREFIX) for record in inputs)


def window_length(config: CompileConfig) -> int:
    total = config.dims.get("total")
    return min(WINDOW, (total.max if total is not None else None) or WINDOW)


def token_windows(config: CompileConfig, path: Path, length: int, limit: int | None) -> np.ndarray:
    """[windows, length] int64 token ids from a .txt (the checkpoint's tokenizer.json) or an .npz's input_ids."""
    if path.suffix == ".txt":
        from tokenizers import Tokenizer

        vocabulary = config.resolve(config.source) / "tokenizer.json"
        if not vocabulary.is_file():
            raise ConfigError(
                f"{path} is text, and {config.source} has no tokenizer.json to read it with",
                hint="pass an .npz of input_ids instead",
            )
        if not path.is_file():
            raise ConfigError(f"{path} does not exist", hint="check --calibration and --eval-data")
        tokenizer = Tokenizer.from_file(str(vocabulary))
        ids = _encode_enough(tokenizer, path.read_text(encoding="utf-8"), None if limit is None else limit * length)
        count = len(ids) // length if limit is None else min(limit, len(ids) // length)
        if count == 0:
            raise ConfigError(f"{path} has {len(ids)} tokens, fewer than one window of {length}", hint="add text")
        return np.array(ids[: count * length], np.int64).reshape(count, length)
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "input_ids" not in archive.files:
                raise ConfigError(f"{path} has no array 'input_ids'", hint="save token ids as input_ids [rows, length]")
            tokens = np.asarray(archive["input_ids"][:limit, :length], np.int64)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {path}: {err}", hint="pass a .txt file or an .npz of input_ids") from err
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ConfigError(f"{path}: input_ids has shape {list(tokens.shape)}", hint="save [rows, length>=2] token ids")
    return tokens


def _encode_enough(tokenizer: Tokenizer, text: str, needed: int | None) -> list[int]:
    """The token ids of `text`, or at least its first `needed` ones: a bounded read (the check before the export,
    64 calibration windows of a large corpus) tokenizes a prefix, not the whole file. The prefix runs
    BOUNDARY_TOKENS past the need, so the word it cuts cannot change the ids kept."""
    if needed is not None:
        characters = (needed + BOUNDARY_TOKENS) * CHARACTERS_PER_TOKEN
        if len(text) > characters:
            ids = tokenizer.encode(text[:characters]).ids
            if len(ids) >= needed + BOUNDARY_TOKENS:
                return list(ids[:needed])
    return list(tokenizer.encode(text).ids)


def prefill_feeds(tokens: np.ndarray, inputs: list[TensorRecord]) -> Feeds:
    """The feeds of a prefill of `tokens` [rows, length] with an empty cache."""
    rows, width = tokens.shape
    feeds = {
        "input_ids": tokens,
        "attention_mask": np.ones_like(tokens),
        "position_ids": np.broadcast_to(np.arange(width), tokens.shape).copy(),
    }
    for record in inputs:
        if record.name.startswith(PAST_PREFIX):
            kv_heads, head_dim = record.shape[1], record.shape[3]
            assert isinstance(kv_heads, int) and isinstance(head_dim, int)
            feeds[record.name] = np.zeros((rows, kv_heads, 0, head_dim), np.float32)
    return {record.name: feeds[record.name] for record in inputs}


@dataclass
class DecoderFeeds:
    """Calibration feeds of a decoder, re-made on every pass: per batch of windows, its prefill, then decode steps
    at DECODE_POINTS of the window over the fp32 cache of the reference graph (none where `decode_steps` is off)."""

    reference: Path
    windows: np.ndarray
    inputs: list[TensorRecord]
    batch_size: int
    _session: Session | None = None
    decode_steps: bool = True

    def __iter__(self) -> Iterator[Feeds]:
        if not self.decode_steps:  # prefills only: nothing to run here (the observer runs them, once)
            for start in range(0, len(self.windows), self.batch_size):
                yield prefill_feeds(self.windows[start : start + self.batch_size], self.inputs)
            return
        # an observer's session over the same graph (AWQ's, calibration's) computes the cache as well: borrowed
        # for this pass rather than a second fp32 session beside it, and its run of each prefill is the one the
        # observer takes (run_remembered), so that every prefill runs once
        session = borrowed = session_over(self.reference)
        if session is None:
            if self._session is None:  # over the narrow twin where there is one: the fp32 file is 6 GB at 1B
                self._session = open_session(self.reference)
            session = self._session
        names = [output.name for output in session.get_outputs()]
        length = self.windows.shape[1]
        for start in range(0, len(self.windows), self.batch_size):
            tokens = self.windows[start : start + self.batch_size]
            prefill = prefill_feeds(tokens, self.inputs)
            if borrowed is not None:
                outputs = run_remembered(borrowed, prefill)
                yield prefill
            else:
                yield prefill
                outputs = dict(zip(names, session.run(None, prefill), strict=True))
            for past in sorted({past_at(point, length) for point in DECODE_POINTS}):
                yield decode_step(tokens, past, self.inputs, outputs)


def prefills_only(data: CalibrationData) -> CalibrationData:
    """`data` without a decoder's decode steps, for statistics of the values a token's row takes: a decode step
    computes, over the cache of the tokens before it, the very rows the prefill computed for its token (causal
    attention), so it adds nothing to them but another pass over every weight (three a window)."""
    if not isinstance(data.source, DecoderFeeds):
        return data
    return replace(data, source=replace(data.source, decode_steps=False, _session=None))


@dataclass(frozen=True)
class TextSplit:
    calibration: CalibrationData | None  # None: calibration statistics stand in for the text (--calibration-stats)
    tokens: np.ndarray  # the evaluation windows [rows, length]
    evaluation: Feeds  # their prefill
    evaluated_on: str


def evaluation_windows(reference: Path, length: int) -> int:
    """How many windows a decoder is evaluated on: EVALUATION_WINDOWS, fewer where their logits would pass
    EVALUATED_BYTES (a large vocabulary), never below MIN_EVALUATION_WINDOWS."""
    model = onnx.load(str(reference), load_external_data=False)
    logits = model.graph.output[0].type.tensor_type.shape.dim
    vocabulary = logits[-1].dim_value if logits and logits[-1].dim_value > 0 else 1
    return int(min(EVALUATION_WINDOWS, max(MIN_EVALUATION_WINDOWS, EVALUATED_BYTES // (4 * length * vocabulary))))


def text_split(config: CompileConfig, inputs: list[TensorRecord], reference: Path) -> TextSplit:
    """Calibration windows (and their decode steps) and evaluation windows, never the same text."""
    length = window_length(config)
    evaluated = evaluation_windows(reference, length)
    windows = None
    if config.calibration is not None:
        source = config.resolve(config.calibration)
        windows = token_windows(config, source, length, config.calibration_samples or CALIBRATION_WINDOWS)
    if config.evaluation is not None:
        evaluation = config.resolve(config.evaluation)
        tokens = token_windows(config, evaluation, length, evaluated)
        described = f"{len(tokens)} windows of {length} tokens of {evaluation.name}"
    elif windows is None:
        raise ConfigError(
            "--calibration-stats needs --eval-data (no calibration text to hold any out of)",
            hint="pass --eval-data PATH",
        )
    elif len(windows) < 2:
        raise ConfigError(
            f"{source} gives {len(windows)} window of {length} tokens: none left to evaluate on",
            hint="add text, or pass --eval-data",
        )
    else:
        held = min(evaluated, max(1, len(windows) // 4))
        windows, tokens = windows[:-held], windows[-held:]
        described = f"{held} windows of {length} tokens held out of {source.name} (its last)"
    data = _calibration_feeds(config, inputs, reference, windows) if windows is not None else None
    return TextSplit(data, tokens, prefill_feeds(tokens, inputs), described)


def past_at(point: float, length: int) -> int:
    """The past length of a decode step at `point` (a fraction) of a window: at least one token, and one left."""
    return max(1, min(length - 1, round(point * length)))


def decode_step(tokens: np.ndarray, past: int, inputs: list[TensorRecord], presents: Mapping[str, np.ndarray]) -> Feeds:
    """Each window's token at position `past`, over the cache of the tokens before it: `presents` are the fp32
    graph's outputs on the windows' prefill (attention is causal, so a window's first p positions are the cache of
    its first p tokens). A state that does not grow with the tokens (a hybrid's) is the whole window's."""
    step = {
        "input_ids": tokens[:, past : past + 1],
        "attention_mask": np.ones((len(tokens), past + 1), np.int64),
        "position_ids": np.full((len(tokens), 1), past, np.int64),
    }
    for record in inputs:
        if record.name.startswith(PAST_PREFIX):
            present = presents["present." + record.name.removeprefix(PAST_PREFIX)][: len(tokens)]
            grows = len(record.shape) > 2 and not isinstance(record.shape[2], int)
            step[record.name] = np.ascontiguousarray(present[:, :, :past] if grows else present)
    return {record.name: step[record.name] for record in inputs}


def decode_timing_step(
    tokens: np.ndarray, inputs: list[TensorRecord], outputs: list[TensorRecord], prefilled: list[np.ndarray]
) -> Feeds:
    """What a decoder's cpu recipe is timed on, as generation runs most: one token of DECODE_TIMING_ROWS windows
    at half their length (decode_step), the cache taken from the evaluation's reference (`prefilled`: the fp32
    graph's outputs on the windows' prefill, in `outputs`' order), so that no model runs for it (at 1B a second
    prefill was 18 s)."""
    past = past_at(DECODE_POINTS[1], tokens.shape[1])
    made = {record.name: array for record, array in zip(outputs, prefilled, strict=True)}
    return decode_step(tokens[:DECODE_TIMING_ROWS], past, inputs, made)


def decoder_calibration(config: CompileConfig, inputs: list[TensorRecord], reference: Path) -> CalibrationData:
    """Every calibration window (up to --calibration-samples), as its prefill and decode steps."""
    assert config.calibration is not None
    windows = token_windows(
        config,
        config.resolve(config.calibration),
        window_length(config),
        config.calibration_samples or CALIBRATION_WINDOWS,
    )
    return _calibration_feeds(config, inputs, reference, windows)


def _calibration_feeds(
    config: CompileConfig, inputs: list[TensorRecord], reference: Path, windows: np.ndarray
) -> CalibrationData:
    specs = [record.spec() for record in inputs]
    batch = calibration_batch(config, reference, windows.shape[1])
    return CalibrationData(DecoderFeeds(reference, windows, inputs, batch), specs, batch_size=batch)


def calibration_batch(config: CompileConfig, reference: Path, length: int) -> int:
    """Windows per calibration batch: `calibration_batch_size` when the config gives it, else the default capped
    so that the tensors a calibration run returns (each weight MatMul's input, and the logits) stay under
    OBSERVED_BYTES: the observer's session holds them all at once. At SmolLM-135M's shape 16 windows of 256 tokens
    returned 2.4 GB a batch; AWQ's statistics pass peaked at 10.6 GB with 5 windows a batch, 6.6 GB with 1."""
    if "calibration_batch_size" in config.model_fields_set:
        return config.calibration_batch_size
    model = onnx.load(str(reference), load_external_data=False)
    shapes = {tensor.name: list(tensor.dims) for tensor in model.graph.initializer}
    widths = sum(
        shapes[node.input[1]][0]
        for node in model.graph.node
        if node.op_type == "MatMul" and len(shapes.get(node.input[1], [])) == 2
    )
    logits = model.graph.output[0].type.tensor_type.shape.dim
    widths += logits[-1].dim_value if logits else 0
    rows = OBSERVED_BYTES // max(1, 4 * length * widths)
    return int(max(1, min(config.calibration_batch_size, rows)))


def check_text_data(config: CompileConfig) -> None:
    """Read the calibration and evaluation text of a decoder before the export: a missing tokenizer or too short
    a text fails in a second."""
    for path in (config.calibration, config.evaluation):
        if path is not None:
            token_windows(config, config.resolve(path), window_length(config), 1)
