"""Automatic prefix caching over the engine's slots (runtime/engine.py), as vLLM's `enable_prefix_caching`.

A slot's cache still holds the keys and values of its last request's tokens after that request ends, and a key or
value at position p depends only on the tokens 0..p. So a new request whose prompt starts with those tokens (a
chat's shared system prompt, a few-shot preamble, a conversation's earlier turns) takes that slot and reads only
the rest of its prompt. A request that shares nothing takes an empty slot, else the one freed longest ago (least
recently used), so that recent prefixes last. At least one prompt token is always read: its logits give the first
new token.

A free slot still runs throwaway rows in decode calls that span it (runtime/slots.py): they must write past the
tokens it keeps, or they would overwrite the first of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MIN_REUSED = 16  # prompt tokens a kept prefix must cover to be worth taking a slot out of the lowest-first order


@dataclass(frozen=True)
class SlotChoice:
    slot: int
    reused: int  # prompt tokens already in the slot's cache


class KeptPrefixes:
    def __init__(self, slots: int, capacity: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self._capacity = capacity
        self._kept: dict[int, np.ndarray] = {}  # slot -> the token ids whose keys and values its cache holds
        self._freed: list[int] = []  # free slots that keep tokens, the longest-freed first

    def choose(self, prompt: np.ndarray, free: Iterable[int]) -> SlotChoice:
        """The free slot for `prompt`: the one keeping its longest prefix (at least MIN_REUSED tokens), else an
        empty one (the lowest), else the one freed longest ago. The slot's kept tokens are forgotten."""
        free = sorted(free)
        best = SlotChoice(free[0], 0)
        if self.enabled:
            for slot in free:
                shared = _shared_prefix(self._kept.get(slot), prompt)
                if shared >= MIN_REUSED and shared > best.reused:
                    best = SlotChoice(slot, shared)
        if best.reused == 0:
            empty = [slot for slot in free if slot not in self._kept]
            best = SlotChoice(empty[0] if empty else next(slot for slot in self._freed if slot in free), 0)
        self._forget(best.slot)
        return best

    def keep(self, slot: int, tokens: np.ndarray) -> None:
        """Slot `slot` was freed holding `tokens` (positions 0..len-1 of its cache)."""
        self._forget(slot)
        if self.enabled and len(tokens):
            self._kept[slot] = tokens
            self._freed.append(slot)

    def throwaway_write(self, slot: int) -> int:
        """Where a free slot's throwaway row writes: past its kept tokens (the last position, the kept tokens
        shortened by one, where they fill the slot)."""
        kept = self._kept.get(slot)
        if kept is None:
            return 0
        if len(kept) >= self._capacity:
            self._kept[slot] = kept[: self._capacity - 1]
            return self._capacity - 1
        return len(kept)

    def _forget(self, slot: int) -> None:
        self._kept.pop(slot, None)
        if slot in self._freed:
            self._freed.remove(slot)


def _shared_prefix(kept: np.ndarray | None, prompt: np.ndarray) -> int:
    """How many leading tokens `kept` and `prompt` share, leaving at least the prompt's last token to read."""
    if kept is None:
        return 0
    length = min(len(kept), len(prompt) - 1)
    differ = np.flatnonzero(kept[:length] != prompt[:length])
    return int(differ[0]) if len(differ) else length
