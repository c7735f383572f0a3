"""What a generation step copies between the host and the device: a pure function of the cache's shape (no CUDA).

With the static cache (runtime/kv_cache.py) on a device the caches and the mask stay there for the whole request,
so a step sends only what it adds and brings back only what the host reads:

    host → device   input_ids, position_ids [rows, new]    rows × new × 8 B each
                    write_indices [rows]                   rows × 8 B
                    attention_mask's new columns           rows × new × 8 B, written at the write index into the
                                                           device's [rows, capacity] mask (a pitched, 2-D copy)
    device → host   the last position's logits             rows × vocab × itemsize
                    (or the chosen token ids, rows × 8 B, when greedy argmax runs on the device)

None of it depends on the past's length or the capacity. The dynamic layout, as the TensorRT backend runs it
through `run`, sends every past and the whole mask in and brings every present and every position's logits back:
for Llama-3.2-1B's shape (16 layers, 8 kv heads, head_dim 64) at 2,048 tokens in fp32 that is
16 × 2 × 8 × 64 × 2,048 × 4 B = 134 MB each way per step (issue 25). `dynamic_step_copies` gives that figure, so
the two can be set side by side. The TensorRT session (runtime/tensorrt_cache.py) copies exactly what
`step_copies` lists and allocates exactly what `device_buffers` and `staging_bytes` list.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from tensorsmith.runtime.kv_cache import WRITE_INDICES, CacheShape, present_of

INDEX_BYTES = 8  # token ids, positions, write indices and the mask are int64
MASK = "attention_mask"
LOGITS = "logits"
NEXT_TOKENS = "next_tokens"  # the chosen ids, where argmax runs on the device


class Direction(enum.Enum):
    TO_DEVICE = "host→device"
    TO_HOST = "device→host"


@dataclass(frozen=True)
class Pitched:
    """A 2-D copy's arguments (cudaMemcpy2DAsync): `height` rows of `width` bytes, `host_pitch` and
    `device_pitch` bytes apart, the device side starting `device_offset` bytes into its buffer."""

    device_offset: int
    device_pitch: int
    host_pitch: int
    width: int
    height: int


@dataclass(frozen=True)
class Transfer:
    """One copy of a step: `rows` rows of `row_bytes` bytes of tensor `tensor`. Contiguous on both sides unless
    `device_pitch` is set: then the device buffer's rows are `device_pitch` bytes apart and the copy lands at the
    step's write index (`column_bytes` bytes a column), as the mask's new columns do."""

    tensor: str
    direction: Direction
    rows: int
    row_bytes: int
    device_pitch: int | None = None
    column_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def pitched(self) -> bool:
        return self.device_pitch is not None and self.device_pitch != self.row_bytes

    def layout(self, write_index: int) -> Pitched:
        """The 2-D copy for a step writing from slot `write_index` (contiguous transfers start at 0)."""
        if not self.pitched:
            return Pitched(0, self.row_bytes, self.row_bytes, self.row_bytes, self.rows)
        assert self.device_pitch is not None
        offset = write_index * self.column_bytes
        if offset + self.row_bytes > self.device_pitch:
            raise ValueError(
                f"{self.tensor}: {self.row_bytes} bytes at byte {offset} overrun its rows of {self.device_pitch}"
            )
        return Pitched(offset, self.device_pitch, self.row_bytes, self.row_bytes, self.rows)


@dataclass(frozen=True)
class CopyPlan:
    """Every copy of one step, host→device ones first."""

    transfers: tuple[Transfer, ...]

    @property
    def to_device(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.direction is Direction.TO_DEVICE)

    @property
    def to_host(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.direction is Direction.TO_HOST)

    @property
    def bytes_to_device(self) -> int:
        return sum(t.nbytes for t in self.to_device)

    @property
    def bytes_to_host(self) -> int:
        return sum(t.nbytes for t in self.to_host)

    @property
    def total_bytes(self) -> int:
        return self.bytes_to_device + self.bytes_to_host

    def by_tensor(self) -> dict[str, int]:
        return {t.tensor: t.nbytes for t in self.transfers}


def step_copies(
    shape: CacheShape, new_tokens: int, vocabulary: int, logits_dtype: np.dtype | str, greedy_on_device: bool = False
) -> CopyPlan:
    """What a static-cache step of `new_tokens` tokens (the prompt's length at prefill, 1 at decode) copies."""
    if not 0 < new_tokens <= shape.capacity:
        raise ValueError(f"a step of {new_tokens} tokens does not fit a cache of {shape.capacity}")
    rows, step_bytes = shape.rows, new_tokens * INDEX_BYTES
    back = (
        Transfer(NEXT_TOKENS, Direction.TO_HOST, rows, INDEX_BYTES)
        if greedy_on_device
        else Transfer(LOGITS, Direction.TO_HOST, rows, vocabulary * np.dtype(logits_dtype).itemsize)
    )
    return CopyPlan(
        (
            Transfer("input_ids", Direction.TO_DEVICE, rows, step_bytes),
            *([Transfer("position_ids", Direction.TO_DEVICE, rows, step_bytes)] if shape.layout.position_ids else []),
            Transfer(WRITE_INDICES, Direction.TO_DEVICE, 1, rows * INDEX_BYTES),
            Transfer(MASK, Direction.TO_DEVICE, rows, step_bytes, shape.capacity * INDEX_BYTES, INDEX_BYTES),
            back,
        )
    )


def dynamic_step_copies(
    shape: CacheShape, past_length: int, new_tokens: int, vocabulary: int, logits_dtype: np.dtype | str
) -> CopyPlan:
    """What a dynamic-cache step copies when every input goes in and every output comes back (the TensorRT
    backend's `run`): the pasts at `past_length` in, the presents at `past_length + new_tokens` and every
    position's logits out."""
    rows, total = shape.rows, past_length + new_tokens
    itemsize = np.dtype(shape.dtype).itemsize

    growing = {*shape.growing_pasts, *map(present_of, shape.growing_pasts)}

    def cache(name: str, direction: Direction, length: int) -> Transfer:
        row_of = int(np.prod(shape.tensor_shape(name, 1)[1:])) * itemsize  # bytes per row and token (a state's all)
        return Transfer(name, direction, rows, row_of * length if name in growing else row_of)

    return CopyPlan(
        (
            Transfer("input_ids", Direction.TO_DEVICE, rows, new_tokens * INDEX_BYTES),
            *(
                [Transfer("position_ids", Direction.TO_DEVICE, rows, new_tokens * INDEX_BYTES)]
                if shape.layout.position_ids
                else []
            ),
            Transfer(MASK, Direction.TO_DEVICE, rows, total * INDEX_BYTES),
            *(cache(name, Direction.TO_DEVICE, past_length) for name in shape.pasts),
            Transfer(LOGITS, Direction.TO_HOST, rows, new_tokens * vocabulary * np.dtype(logits_dtype).itemsize),
            *(cache(present_of(name), Direction.TO_HOST, total) for name in shape.pasts),
        )
    )


def device_buffers(shape: CacheShape, vocabulary: int, logits_dtype: np.dtype | str) -> dict[str, int]:
    """Every device buffer of a static-cache request, in bytes: the caches and the mask at the capacity (each
    present shares its past's buffer), and each step's inputs and output at their largest (a step as long as
    the cache)."""
    steps = {t.tensor: t.nbytes for t in step_copies(shape, shape.capacity, vocabulary, logits_dtype).transfers}
    return {**shape.reserved_bytes, **{name: size for name, size in steps.items() if name != MASK}}


def staging_bytes(shape: CacheShape, vocabulary: int, logits_dtype: np.dtype | str) -> dict[str, int]:
    """The pinned host buffers a step copies from and into, at their largest: one per transfer of the plan."""
    return step_copies(shape, shape.capacity, vocabulary, logits_dtype).by_tensor()
