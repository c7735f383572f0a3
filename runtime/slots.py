"""A fixed set of cache slots shared by concurrent requests (continuous batching, runtime/engine.py).

One allocation at start: every past is [slots, kv_heads, capacity, head_dim] (a state [slots, *its shape]) and
the mask [slots, capacity]. A request owns one slot from its prefill to its last token. A model call runs a
contiguous range of slots (`rows`, a slice of the leading axis: a view, no copy), each row with its own write
index, positions and mask row, which the static cache graph takes per row (passes/static_cache.py).

Rows in a call that hold no decoding request (a free slot, or one between prefill chunks) compute a throwaway
token: it is written where the slot's next real write lands (a free slot's: past the tokens it keeps for a later
prompt, runtime/prefix_cache.py; a prefilling slot's next position), so nothing visible changes. Every row keeps
one unmasked column, so no row's softmax is over nothing: an all-masked row would make NaNs, and a NaN left in a
cache poisons later steps (0 × NaN in the attention). A recurrent layer's state has no position to aim a throwaway
at: a row's new state is kept only where the row is visible, so a request between prefill chunks keeps the state
its last chunk left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensorsmith.runtime.kv_cache import WRITE_INDICES, CacheShape, Run, present_of


@dataclass(frozen=True)
class SlotFeeds:
    """One call over `rows`: token ids and positions [rows, new], each row's first write slot [rows]."""

    rows: slice
    input_ids: np.ndarray
    position_ids: np.ndarray
    write_indices: np.ndarray

    def small(self, positions: bool) -> dict[str, np.ndarray]:
        ids = {"input_ids": self.input_ids, WRITE_INDICES: self.write_indices}
        return {**ids, **({"position_ids": self.position_ids} if positions else {})}


class SlotCache:
    """The slots in host arrays, run through any backend's `run`: the call reads views of its rows and the
    presents are copied back into them. Backends that write the presents in place subclass it (`_run_rows`)."""

    def __init__(self, run: Run, shape: CacheShape) -> None:
        self.shape = shape
        self._run = run
        self.mask = np.zeros((shape.rows, shape.capacity), np.int64)
        self.mask[:, 0] = 1  # see the module's note: a free slot attends to one (finite) column
        self.cache = {name: np.zeros(shape.tensor_shape(name), shape.dtype) for name in shape.pasts}
        self.states = shape.state_pasts

    @property
    def slots(self) -> int:
        return self.shape.rows

    @property
    def capacity(self) -> int:
        return self.shape.capacity

    def start(self, slot: int, keep: int = 0) -> None:
        """Slot `slot` begins a request: its mask forgets the last one's tokens but the first `keep` (a shared
        prefix: runtime/prefix_cache.py), and keeps one column until its prompt is read."""
        self.mask[slot] = 0
        self.mask[slot, : max(keep, 1)] = 1
        for name in self.states:  # a recurrent layer starts from zero: the last request's state is not this one's
            self.cache[name][slot] = 0

    def release(self, slot: int) -> None:
        """Slot `slot` is free again: one column stays unmasked."""
        self.mask[slot] = 0
        self.mask[slot, 0] = 1

    def step(self, feeds: SlotFeeds, visible: np.ndarray) -> np.ndarray:
        """Run `feeds`; `visible` [rows] says which rows' new tokens join their mask (0 for a throwaway row).
        Returns each row's last-position logits [rows, vocab]."""
        first = feeds.rows.start or 0
        new = feeds.input_ids.shape[1]
        for offset, index in enumerate(feeds.write_indices):
            if visible[offset]:
                end = int(index) + new
                if end > self.capacity:
                    raise ValueError(f"slot {first + offset} writes up to {end}, past the cache's {self.capacity}")
                self.mask[first + offset, int(index) : end] = 1
        return self._run_rows(feeds, visible)

    def _run_rows(self, feeds: SlotFeeds, visible: np.ndarray) -> np.ndarray:
        rows = feeds.rows
        pasts = {name: cache[rows] for name, cache in self.cache.items()}
        outputs = self._run({**feeds.small(self.shape.layout.position_ids), "attention_mask": self.mask[rows], **pasts})
        for name, past in pasts.items():
            if name in self.states:
                past[visible] = outputs[present_of(name)][visible]
            else:
                np.copyto(past, outputs[present_of(name)])
        return np.asarray(outputs["logits"])[:, -1, :]

    def close(self) -> None:
        """Release the slots' buffers."""
