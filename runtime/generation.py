"""Text generation over a decoder artifact's KV-cache graph: prefill the prompt, then one token per step.

The same loop serves every backend and both cache layouts: it only calls a request's cache session
(runtime/kv_cache.py: `step`, `reorder`), which the backend keeps where it computes. It follows transformers'
`generate` where the issue asks for the same tokens: greedy and beam search pick as it does (argmax; the top
`2 × beams` continuations of the running log-probabilities), finished rows are padded with `pad_token_id`, a
batch of prompts is left padded (positions counted from each row's first real token). Sampling applies
temperature, top-k and top-p in transformers' order, with numpy's generator (so the same seed gives the same text
here, not torch's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from tensorsmith.runtime.generation_request import Request
from tensorsmith.runtime.kv_cache import CacheSession, StepFeeds
from tensorsmith.runtime.sampling import Sampling, log_softmax


class TokenStreamer(Protocol):
    """transformers' streamer protocol (TextStreamer, TextIteratorStreamer): the prompt, each step's tokens, the
    end."""

    def put(self, value: np.ndarray) -> None: ...
    def end(self) -> None: ...


# what `generate` hands each step's tokens to: transformers' streamer, or a function of the tokens
Streamer = TokenStreamer | Callable[[np.ndarray], object]


class Generator:
    """One request's loop: prefill, then a token per step, over a KV cache the backend keeps
    (runtime/kv_cache.py: `open_cache(rows, capacity)`)."""

    def __init__(self, open_cache: Callable[[int, int], CacheSession]) -> None:
        self._open_cache = open_cache

    def generate(self, request: Request, streamer: Streamer | None = None) -> np.ndarray:
        """Run a request as checked (generation_request.check_request): its sequences, prompt included."""
        prompt, mask = request.prompt, request.mask
        if request.num_beams > 1:
            return self._beam_search(prompt, mask, request.max_new_tokens, request.num_beams)
        return self._sample(
            prompt, mask, request.max_new_tokens, request.sampling, request.eos, request.pad, request.seed, streamer
        )

    def _sample(
        self,
        prompt: np.ndarray,
        mask: np.ndarray,
        max_new_tokens: int,
        sampling: Sampling,
        eos: list[int],
        pad: int,
        seed: int | None,
        streamer: Streamer | None,
    ) -> np.ndarray:
        rng = np.random.default_rng(seed)
        rows, length = prompt.shape
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        # transformers' streamers take the prompt first (skip_prompt drops that put)
        if streamer is not None and hasattr(streamer, "put"):
            streamer.put(prompt)
        with self._open_cache(rows, length + max_new_tokens) as cache:
            logits = cache.step(StepFeeds(prompt, positions, 0, mask))
            sequences, unfinished = prompt, np.ones(rows, dtype=bool)
            ones = np.ones((rows, 1), np.int64)
            for step in range(max_new_tokens):
                chosen = np.where(unfinished, sampling.choose(logits, rng), pad).astype(np.int64)
                sequences = np.concatenate([sequences, chosen[:, None]], axis=1)
                _stream(streamer, chosen)
                unfinished &= ~np.isin(chosen, eos)
                if not unfinished.any() or step == max_new_tokens - 1:
                    break
                positions = positions[:, -1:] + 1
                logits = cache.step(StepFeeds(chosen[:, None], positions, length + step, ones))
        _stream_end(streamer)
        return sequences

    def _beam_search(self, prompt: np.ndarray, mask: np.ndarray, max_new_tokens: int, beams: int) -> np.ndarray:
        """transformers' beam search with its defaults (length_penalty 1.0, early_stopping False) for
        `max_new_tokens` steps: the best beam by summed log-probability per row. EOS does not end a beam early
        (transformers' finished-hypothesis bookkeeping is not reproduced yet)."""
        rows, length = prompt.shape
        expanded_mask = np.repeat(mask, beams, axis=0)
        positions = np.clip(np.cumsum(expanded_mask, axis=1) - 1, 0, None)
        with self._open_cache(rows * beams, length + max_new_tokens) as cache:
            logits = cache.step(StepFeeds(np.repeat(prompt, beams, axis=0), positions, 0, expanded_mask))
            scores = np.zeros((rows, beams))
            scores[:, 1:] = -1e9  # the first step expands beam 0 only: the beams start identical
            sequences = np.repeat(prompt, beams, axis=0)
            ones = np.ones((rows * beams, 1), np.int64)
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
                cache.reorder(origin)
                positions = positions[origin][:, -1:] + 1
                logits = cache.step(StepFeeds(tokens[:, None], positions, length + step, ones))
        best_beam = scores.argmax(-1) + np.arange(rows) * beams
        return sequences[best_beam]


def _stream(streamer: Streamer | None, tokens: np.ndarray) -> None:
    if streamer is None:
        return
    if hasattr(streamer, "put"):  # transformers' streamer protocol (TextStreamer, TextIteratorStreamer)
        streamer.put(tokens)
    else:
        streamer(tokens)


def _stream_end(streamer: Streamer | None) -> None:
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
