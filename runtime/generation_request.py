"""A `generate()` request, checked against the artifact's manifest before anything runs: every setting in its
range and every token id in the vocabulary, each refused with an `InputError` that names it (else a bad id
comes back as ONNX Runtime's Gather error, and a negative `max_new_tokens` as an empty answer)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from tensorsmith.runtime.errors import InputError
from tensorsmith.runtime.manifest import GenerationRecord, Manifest
from tensorsmith.runtime.sampling import Sampling


@dataclass(frozen=True)
class Request:
    """What the generation loop runs: the prompt and mask as [rows, length] int64, and settings in range."""

    layout: GenerationRecord
    prompt: np.ndarray
    mask: np.ndarray
    max_new_tokens: int
    sampling: Sampling
    num_beams: int
    eos: list[int]
    pad: int
    seed: int | None


def vocabulary_size(manifest: Manifest) -> int | None:
    """The decoder's vocabulary: the last dim of its logits (None where the manifest does not fix it)."""
    logits = next((record for record in manifest.outputs if record.name == "logits"), None)
    size = logits.shape[-1] if logits is not None and logits.shape else None
    return size if isinstance(size, int) else None


def check_request(
    manifest: Manifest,
    origin: str,
    input_ids: object,
    attention_mask: object = None,
    max_new_tokens: int = 20,
    sampling: Sampling | None = None,
    num_beams: int = 1,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
) -> Request:
    """The request `Model.generate` (and `tensorsmith generate`, before it loads the artifact at `origin`) runs,
    or an InputError naming the first argument that is wrong."""
    layout = manifest.generation
    if layout is None:
        raise InputError(
            f"{origin} is not a decoder artifact (its manifest has no generation record)",
            hint="generate() is for a compiled *ForCausalLM checkpoint; use run() for others",
        )
    sampling = sampling or Sampling()
    _check_settings(max_new_tokens, sampling, num_beams, seed)
    if eos_token_id is None:
        eos = list(layout.eos_token_id)  # the checkpoint's
    else:
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else layout.pad_token_id
    if pad is None:
        pad = (eos or [0])[0]
    prompt, mask = _rows(input_ids, attention_mask)
    vocabulary = vocabulary_size(manifest)
    if vocabulary is not None:
        _check_ids(prompt, pad, vocabulary)
    room = layout.max_sequence_length - prompt.shape[1]
    if max_new_tokens > room:
        raise InputError(
            f"a prompt of {prompt.shape[1]} tokens leaves room for {max(room, 0)} new tokens, not {max_new_tokens}"
            f" (max_sequence_length {layout.max_sequence_length})",
            hint="ask for fewer new tokens, or recompile with a larger --max-sequence-length",
        )
    return Request(layout, prompt, mask, max_new_tokens, sampling, num_beams, eos, pad, seed)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:  # numpy's scalars too (np.float32 is no float)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_settings(max_new_tokens: int, sampling: Sampling, num_beams: int, seed: int | None) -> None:
    """Each setting in its range, in any mode: a value out of range is a mistake even where the mode ignores it."""
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(
            f"max_new_tokens is {max_new_tokens!r}, and must be an integer of at least 1",
            hint="ask for 1 new token or more",
        )
    if not _is_int(num_beams) or num_beams < 1:
        raise InputError(
            f"num_beams is {num_beams!r}, and must be an integer of at least 1",
            hint="1 decodes greedily or samples; more searches beams",
        )
    if sampling.do_sample and num_beams > 1:  # the beam search here does not sample: it would be ignored
        raise InputError(
            f"do_sample with num_beams {num_beams}: beam sampling is not supported",
            hint="sample with num_beams 1, or search beams without do_sample",
        )
    temperature = sampling.temperature
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise InputError(
            f"temperature is {temperature!r}, and must be a number above 0",
            hint="sampling divides the logits by it: try 0.7",
        )
    if not _is_int(sampling.top_k) or sampling.top_k < 0:
        raise InputError(
            f"top_k is {sampling.top_k!r}, and must be an integer of at least 0",
            hint="0 keeps every token, k the k likeliest",
        )
    top_p = sampling.top_p
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InputError(
            f"top_p is {top_p!r}, and must lie in (0, 1]",
            hint="1 keeps every token, 0.9 the likeliest worth 90% of the probability",
        )
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise InputError(f"seed is {seed!r}, and must be an integer of at least 0", hint="any integer from 0 up")


def _rows(input_ids: object, attention_mask: object) -> tuple[np.ndarray, np.ndarray]:
    """The prompt and its mask as [rows, length] int64 (one prompt may be 1-D)."""
    ids = np.asarray(input_ids)
    if ids.dtype.kind not in "iu" and ids.size:  # a float array would be cast silently
        raise InputError(f"input_ids are {ids.dtype}, not token ids", hint="pass integer token ids (np.int64)")
    prompt = (ids[None, :] if ids.ndim == 1 else ids).astype(np.int64)
    if prompt.ndim != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise InputError(
            f"input_ids have shape {ids.shape}, not [rows, length] with a token or more",
            hint="pass one prompt [length] or a batch [rows, length]",
        )
    mask = np.ones_like(prompt) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if mask.shape != prompt.shape:
        raise InputError(
            f"attention_mask has shape {mask.shape}, input_ids {prompt.shape}: they must match",
            hint="one mask value per token: 1 for a token, 0 for left padding",
        )
    return prompt, mask


def _check_ids(prompt: np.ndarray, pad: int, vocabulary: int) -> None:
    """Every prompt id (padding included: it is embedded too) and the pad id (fed for finished rows) a row of the
    embedding table."""
    outside = np.argwhere((prompt < 0) | (prompt >= vocabulary))
    if len(outside):
        row, position = (int(index) for index in outside[0])
        raise InputError(
            f"input_ids[{row}, {position}] is {int(prompt[row, position])}, outside the vocabulary of "
            f"{vocabulary} (ids 0..{vocabulary - 1})",
            hint="token ids come from the artifact's tokenizer, tokenizer/tokenizer.json",
        )
    if not _is_int(pad) or not 0 <= pad < vocabulary:
        raise InputError(
            f"pad_token_id {pad!r} is outside the vocabulary of {vocabulary} (ids 0..{vocabulary - 1})",
            hint="pass a pad_token_id the tokenizer has (its pad or eos id)",
        )
