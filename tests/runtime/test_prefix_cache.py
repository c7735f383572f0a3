"""Automatic prefix caching (runtime/prefix_cache.py): which free slot a prompt takes, where a free slot's
throwaway rows write, and, on samples/tinylm compiled for the cpu target, a prompt that starts as a finished
request's did reads only its own rest from that slot and still gives generate()'s tokens, while a decode call
runs over the slot in between."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tensorsmith.runtime import Model, load
from tensorsmith.runtime.prefix_cache import MIN_REUSED, KeptPrefixes, SlotChoice

SYSTEM = "You are a helpful assistant who answers questions about the Python language briefly and exactly. "


def tokens(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def test_the_slot_keeping_the_longest_prefix_is_taken() -> None:
    prefixes = KeptPrefixes()
    shared = np.arange(100, 100 + MIN_REUSED + 4)
    prefixes.keep(1, shared[: MIN_REUSED + 1])
    prefixes.keep(2, np.concatenate([shared, tokens(7, 8)]))
    choice = prefixes.choose(np.concatenate([shared, tokens(9)]), free=[0, 1, 2, 3])
    assert (choice.slot, choice.reused) == (2, len(shared))
    # the slot's kept tokens belong to the new request now: not offered twice
    assert prefixes.choose(np.concatenate([shared, tokens(9)]), free=[0, 1, 3]).slot == 1


def test_a_prompt_sharing_less_than_the_minimum_takes_the_lowest_free_slot() -> None:
    """As without prefix caching, so that the running requests stay packed and decode calls run few spare rows."""
    prefixes = KeptPrefixes()
    prefixes.keep(1, np.arange(MIN_REUSED))
    short = np.arange(MIN_REUSED - 2)  # shares MIN_REUSED - 3 tokens with slot 1 (its last is always read): too few
    assert prefixes.choose(short, free=[1, 2, 3]) == SlotChoice(1, 0)
    assert prefixes.throwaway_write(1) == 0  # forgotten: slot 1 is the new request's


def test_the_prompts_last_token_is_always_read() -> None:
    prefixes = KeptPrefixes()
    prompt = np.arange(MIN_REUSED + 5)
    prefixes.keep(0, np.concatenate([prompt, tokens(1, 2, 3)]))
    assert prefixes.choose(prompt, free=[0]).reused == len(prompt) - 1  # its logits give the first new token


def test_a_free_slots_throwaway_writes_past_what_it_keeps() -> None:
    prefixes = KeptPrefixes()
    assert prefixes.throwaway_write(0) == 0  # nothing kept
    prefixes.keep(0, np.arange(5))
    assert prefixes.throwaway_write(0) == 5


def test_after_a_failed_step_or_switched_off_nothing_is_kept() -> None:
    prefixes = KeptPrefixes()
    prefixes.keep(1, np.arange(40))
    prefixes.forget_all()
    assert prefixes.choose(np.arange(30), free=[0, 1]) == SlotChoice(0, 0)
    off = KeptPrefixes(enabled=False)
    off.keep(1, np.arange(40))
    assert off.choose(np.arange(30), free=[1]).reused == 0 and off.throwaway_write(1) == 0


@pytest.fixture(scope="module")
def model(tinylm_cpu_artifact: Path) -> Iterator[Model]:
    with load(tinylm_cpu_artifact, backend="onnxruntime") as loaded:
        yield loaded


@pytest.fixture(scope="module")
def encode(tinylm_cpu_artifact: Path) -> Iterator[object]:
    tokenizer = Tokenizer.from_file(str(tinylm_cpu_artifact / "tokenizer" / "tokenizer.json"))
    yield lambda text: np.array(tokenizer.encode(text).ids, np.int64)


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_system_prompt_is_read_once_and_the_tokens_stay_generates(
    model: Model, encode: object, caching: bool
) -> None:
    """Slots 0 and 2 decode long requests; the request in slot 1 ends, and the decode calls that follow run over
    slot 1 with a throwaway row. A second request with the same system prompt then takes slot 1 and reads only
    what follows the shared tokens; every request's tokens are generate()'s."""
    first, second = (encode(SYSTEM + question) for question in ("What is a list?", "What does yield do?"))
    shared = int(np.argmin(first[: len(second)] == second[: len(first)]))
    assert shared >= MIN_REUSED
    long = [encode("The for statement is used to iterate over"), encode("import os")]
    expected = [
        model.generate(prompt, max_new_tokens=40, eos_token_id=[])[0, len(prompt) :].tolist() for prompt in long
    ]
    expected_second = model.generate(second, max_new_tokens=8, eos_token_id=[])[0, len(second) :].tolist()
    with model.engine(slots=3, prefill_chunk=512, prefix_caching=caching) as engine:
        with engine._turn:  # admitted together, in this order, into slots 0, 1 and 2 (the engine waits meanwhile)
            left = engine.submit(long[0], max_new_tokens=40, ignore_eos=True)
            ended = engine.submit(first, max_new_tokens=3, ignore_eos=True)
            right = engine.submit(long[1], max_new_tokens=40, ignore_eos=True)
        list(ended)  # slot 1 is free again; slots 0 and 2 go on decoding over it
        again = engine.submit(second, max_new_tokens=8, ignore_eos=True)
        got = list(again)
        assert [list(left), list(right)] == expected
    assert got == expected_second
    assert again.cached_tokens == (shared if caching else 0) and ended.cached_tokens == 0
