"""The continuous-batching engine (runtime/engine.py) over samples/tinylm compiled for the cpu target: its tokens
are generate()'s, requests join and leave while others decode, and every slot comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tensorsmith.runtime import InputError, Model, load
from tensorsmith.runtime.engine import GenerationEngine, QueueFull

PROMPTS = [
    "The with statement",
    "A class definition",
    "def f(x):",
    "Exceptions are raised when",
    "import os",
    "The for statement is used to iterate over the elements of a sequence",
    "Return",
    "x",
]


@pytest.fixture(scope="module")
def model(tinylm_cpu_artifact: Path) -> Iterator[Model]:
    with load(tinylm_cpu_artifact, backend="onnxruntime") as loaded:
        yield loaded


@pytest.fixture(scope="module")
def prompts(tinylm_cpu_artifact: Path) -> list[np.ndarray]:
    tokenizer = Tokenizer.from_file(str(tinylm_cpu_artifact / "tokenizer" / "tokenizer.json"))
    return [np.array(tokenizer.encode(text).ids, np.int64) for text in PROMPTS]


def _wait_idle(engine: GenerationEngine) -> None:
    deadline = time.monotonic() + 10
    while (engine.stats().running or engine.stats().waiting) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_greedy_tokens_are_generates_with_more_requests_than_slots(model: Model, prompts: list[np.ndarray]) -> None:
    """8 prompts, 3 slots, prompts read 4 tokens a step: requests wait, join while others decode, end at
    different steps; each one's tokens are generate()'s for it alone."""
    lengths = [40, 7, 25, 1, 33, 12, 40, 18]
    expected = [
        model.generate(prompt, max_new_tokens=n)[0, len(prompt) :].tolist()
        for prompt, n in zip(prompts, lengths, strict=True)
    ]
    with model.engine(slots=3, prefill_chunk=4) as engine:
        streams = [engine.submit(prompt, max_new_tokens=n) for prompt, n in zip(prompts, lengths, strict=True)]
        got = [list(stream) for stream in streams]
        assert engine.stats().running == 0 and engine.stats().waiting == 0
    assert got == expected
    for stream, tokens, n in zip(streams, got, lengths, strict=True):
        assert stream.finish_reason == ("stop" if tokens[-1] == 2 else "length") and len(tokens) <= n
        assert stream.prompt_tokens > 0 and stream.timings.time_to_first_token is not None


def test_sampling_with_a_seed_is_generates(model: Model, prompts: list[np.ndarray]) -> None:
    settings = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}
    expected = model.generate(prompts[0], max_new_tokens=30, **settings)[0, len(prompts[0]) :].tolist()
    with model.engine(slots=2) as engine:
        others = [engine.submit(prompt, max_new_tokens=30, do_sample=True, seed=i) for i, prompt in enumerate(prompts)]
        sampled = list(engine.submit(prompts[0], max_new_tokens=30, **settings))
        for other in others:
            list(other)
    assert sampled == expected


def test_a_stop_token_ends_the_request(model: Model, prompts: list[np.ndarray]) -> None:
    greedy = model.generate(prompts[0], max_new_tokens=20)[0, len(prompts[0]) :].tolist()
    with model.engine(slots=2) as engine:
        stream = engine.submit(prompts[0], max_new_tokens=20, stop_token_ids=[greedy[5]])
        tokens = list(stream)
    assert tokens == greedy[: greedy.index(greedy[5]) + 1] and stream.finish_reason == "stop"


def test_cancelled_requests_free_their_slots(model: Model, prompts: list[np.ndarray]) -> None:
    with model.engine(slots=2) as engine:
        long = [engine.submit(prompt, max_new_tokens=400, ignore_eos=True) for prompt in prompts[:2]]
        waiting = engine.submit(prompts[2], max_new_tokens=5)
        for stream in long:
            next(iter(stream))  # decoding: both slots taken
            stream.cancel()
        assert list(waiting) == model.generate(prompts[2], max_new_tokens=5)[0, len(prompts[2]) :].tolist()
        _wait_idle(engine)
        assert engine.stats().running == 0
    assert [stream.finish_reason for stream in long] == ["cancelled", "cancelled"]
    assert all(len(stream.tokens) < 400 for stream in long)


def test_async_streams_in_an_event_loop(model: Model, prompts: list[np.ndarray]) -> None:
    async def collect(engine: GenerationEngine) -> list[list[int]]:
        async def one(prompt: np.ndarray) -> list[int]:
            return [token async for token in engine.submit(prompt, max_new_tokens=10)]

        return await asyncio.gather(*(one(prompt) for prompt in prompts[:4]))

    with model.engine(slots=4) as engine:
        got = asyncio.run(collect(engine))
    assert got == [model.generate(prompt, max_new_tokens=10)[0, len(prompt) :].tolist() for prompt in prompts[:4]]


def test_the_queue_and_the_slots_have_limits(model: Model, prompts: list[np.ndarray]) -> None:
    with model.engine(slots=1, max_queue=1, max_sequence_length=64) as engine:
        running = engine.submit(prompts[0], max_new_tokens=50, ignore_eos=True)
        queued = engine.submit(prompts[1], max_new_tokens=5)
        with pytest.raises(QueueFull, match="max_queue 1"):
            engine.submit(prompts[2], max_new_tokens=5)
        with pytest.raises(InputError, match="do not fit the engine's 64-token slots"):
            engine.submit(np.ones(60, np.int64), max_new_tokens=10)
        with pytest.raises(InputError, match="outside the vocabulary"):
            engine.submit(np.array([1, 99999]), max_new_tokens=10)
        assert len(list(running)) == 50 and list(queued)
    with pytest.raises(InputError, match="slots is 9, and must be an integer from 1 to 8"):
        model.engine(slots=9)


def test_the_dynamic_cache_is_refused(tinylm_dynamic_cache_artifact: Path) -> None:
    with load(tinylm_dynamic_cache_artifact) as loaded, pytest.raises(InputError, match="needs the static cache"):
        loaded.engine()
