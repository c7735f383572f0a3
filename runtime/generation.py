"""Text generation over a decoder artifact's KV-cache graph: prefill the prompt, then one token per step.

The same loop serves every backend (it only calls `run`). It follows transformers' `generate` where the issue
asks for the same tokens: greedy and beam search pick as it does (argmax; the top `2 × beams` continuations of
the running log-probabilities), finished rows are padded with `pad_token_id`, a batch of prompts is left
padded (positions counted from each row's first real token). Sampling applies temperature, top-k and top-p in
transformers' order, with numpy's generator (so the same seed gives the same text here, not torch's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorsmith.runtime.manifest import GenerationRecord

Run = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def choose(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One token per row of `logits` [rows, vocab]."""
        if not self.do_sample:
            return logits.argmax(-1)
        scores = logits.astype(np.float64) / max(self.temperature, 1e-6)
        if 0 < self.top_k < scores.shape[-1]:
            kth = np.sort(scores, axis=-1)[:, -self.top_k][:, None]
            scores = np.where(scores < kth, -np.inf, scores)
        if self.top_p < 1.0:
            order = np.argsort(scores, axis=-1)  # ascending, as transformers' TopPLogitsWarper
            probabilities = _softmax(np.take_along_axis(scores, order, -1))
            removed = np.cumsum(probabilities, axis=-1) <= 1 - self.top_p
            removed[:, -1] = False  # keep at least one token
            np.put_along_axis(scores, order, np.where(removed, -np.inf, np.take_along_axis(scores, order, -1)), -1)
        probabilities = _softmax(scores)
        return np.array([rng.choice(len(row), p=row) for row in probabilities])


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    scores = logits.astype(np.float64)
    shifted = scores - scores.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


class Generator:
    """One request's state: the KV cache, mask and positions of every row, advanced one step at a time."""

    def __init__(
        self, run: Run, layout: GenerationRecord, cache_dtype: str, reserve: Callable[[dict[str, int]], None]
    ) -> None:
        self._run = run
        self._reserve = reserve  # the backend's: its buffers sized once per request
        self.layout = layout
        self.cache_dtype = np.dtype(cache_dtype)

    def _reserve_request(self, rows: int, longest: int) -> None:
        """The cache, mask and presents at their longest for this request: a backend that keeps device buffers
        (TensorRT) allocates them once, not as they grow by a token per step."""
        cache = rows * self.layout.kv_heads * longest * self.layout.head_dim * self.cache_dtype.itemsize
        nbytes = {"attention_mask": rows * longest * 8}
        for i in range(self.layout.layers):
            for kind in ("key", "value"):
                nbytes[f"past_key_values.{i}.{kind}"] = nbytes[f"present.{i}.{kind}"] = cache
        self._reserve(nbytes)

    def _empty_cache(self, rows: int) -> dict[str, np.ndarray]:
        shape = (rows, self.layout.kv_heads, 0, self.layout.head_dim)
        return {f"past_key_values.{i}.{kind}": np.zeros(shape, self.cache_dtype)
                for i in range(self.layout.layers) for kind in ("key", "value")}  # fmt: skip

    def step(self, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray, cache: dict[str, np.ndarray]
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # fmt: skip
        """Logits of the last position [rows, vocab], and the cache with these tokens in it."""
        outputs = self._run({"input_ids": tokens, "attention_mask": mask, "position_ids": positions, **cache})
        presents = {f"past_key_values.{i}.{kind}": outputs[f"present.{i}.{kind}"]
                    for i in range(self.layout.layers) for kind in ("key", "value")}  # fmt: skip
        return outputs["logits"][:, -1, :], presents

    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray | None, max_new_tokens: int,
                 sampling: Sampling, num_beams: int, eos_token_id: list[int], pad_token_id: int,
                 seed: int | None, streamer: Any) -> np.ndarray:  # fmt: skip
        """Run a request as given: `Model.generate` checks it first (generation_request.check_request)."""
        prompt = np.asarray(input_ids, dtype=np.int64)
        if prompt.ndim == 1:
            prompt = prompt[None, :]
        mask = np.ones_like(prompt) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        if num_beams > 1:
            return self._beam_search(prompt, mask, max_new_tokens, num_beams)
        return self._sample(prompt, mask, max_new_tokens, sampling, eos_token_id, pad_token_id, seed, streamer)

    def _sample(self, prompt: np.ndarray, mask: np.ndarray, max_new_tokens: int, sampling: Sampling,
                eos: list[int], pad: int, seed: int | None, streamer: Any) -> np.ndarray:  # fmt: skip
        rng = np.random.default_rng(seed)
        self._reserve_request(len(prompt), prompt.shape[1] + max_new_tokens)
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        logits, cache = self.step(prompt, mask, positions, self._empty_cache(len(prompt)))
        sequences, unfinished = prompt, np.ones(len(prompt), dtype=bool)
        for step in range(max_new_tokens):
            chosen = np.where(unfinished, sampling.choose(logits, rng), pad).astype(np.int64)
            sequences = np.concatenate([sequences, chosen[:, None]], axis=1)
            _stream(streamer, chosen)
            unfinished &= ~np.isin(chosen, eos)
            if not unfinished.any() or step == max_new_tokens - 1:
                break
            mask = np.concatenate([mask, np.ones((len(mask), 1), np.int64)], axis=1)
            positions = positions[:, -1:] + 1
            logits, cache = self.step(chosen[:, None], mask, positions, cache)
        _stream_end(streamer)
        return sequences

    def _beam_search(self, prompt: np.ndarray, mask: np.ndarray, max_new_tokens: int, beams: int) -> np.ndarray:
        """transformers' beam search with its defaults (length_penalty 1.0, early_stopping False) for
        `max_new_tokens` steps: the best beam by summed log-probability per row. EOS does not end a beam early
        (transformers' finished-hypothesis bookkeeping is not reproduced yet)."""
        rows = len(prompt)
        self._reserve_request(rows * beams, prompt.shape[1] + max_new_tokens)
        expanded_mask = np.repeat(mask, beams, axis=0)
        positions = np.clip(np.cumsum(expanded_mask, axis=1) - 1, 0, None)
        logits, cache = self.step(np.repeat(prompt, beams, axis=0), expanded_mask, positions,
                                  self._empty_cache(rows * beams))  # fmt: skip
        scores = np.zeros((rows, beams))
        scores[:, 1:] = -1e9  # the first step expands beam 0 only: the beams start identical
        sequences = np.repeat(prompt, beams, axis=0)
        for step in range(max_new_tokens):
            vocabulary = logits.shape[-1]
            candidates = (scores.reshape(-1, 1) + log_softmax(logits)).reshape(rows, beams * vocabulary)
            best = np.argsort(-candidates, axis=-1, kind="stable")[:, :beams]
            scores = np.take_along_axis(candidates, best, -1)
            origin = (best // vocabulary + np.arange(rows)[:, None] * beams).reshape(-1)
            tokens = (best % vocabulary).reshape(-1).astype(np.int64)
            sequences = np.concatenate([sequences[origin], tokens[:, None]], axis=1)
            if step == max_new_tokens - 1:
                break
            cache = {name: value[origin] for name, value in cache.items()}
            expanded_mask = np.concatenate([expanded_mask, np.ones((rows * beams, 1), np.int64)], axis=1)
            positions = positions[origin][:, -1:] + 1
            logits, cache = self.step(tokens[:, None], expanded_mask, positions, cache)
        best_beam = scores.argmax(-1) + np.arange(rows) * beams
        return sequences[best_beam]


def _stream(streamer: Any, tokens: np.ndarray) -> None:
    if streamer is None:
        return
    if hasattr(streamer, "put"):  # transformers' streamer protocol (TextStreamer, TextIteratorStreamer)
        streamer.put(tokens)
    else:
        streamer(tokens)


def _stream_end(streamer: Any) -> None:
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
