"""A generation request's KV cache, kept where the backend computes and handed to each step.

Two layouts (the manifest's `generation.kv_cache`):

- **static** (passes/static_cache.py): the caches are as long as the request from the first step; a step writes
  its keys and values at `write_indices` (TensorScatter) and the mask `attention_mask [rows, capacity]` says
  which slots hold real tokens. Present is past with the step written in, so a backend that binds each present
  to its past's buffer updates the cache in place and a step moves only its new tokens, positions and mask
  columns (runtime/copy_plan.py). `StaticCacheSession` keeps the cache in numpy arrays and copies the presents
  back (any backend); ONNX Runtime binds them in place (onnxruntime_cache.py), TensorRT keeps them on the
  device (tensorrt_cache.py).
- **dynamic** (Optimum's and ONNX Runtime GenAI's names): the cache grows by a Concat in the graph, the mask by
  a column per step; `DynamicCacheSession` feeds the presents back as the next pasts.

Prompts are left padded, so a step's first slot is the same for every row: `StepFeeds.write_index`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from tensorsmith.runtime.manifest import GenerationRecord

Run = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
WRITE_INDICES = "write_indices"


def past_name(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def present_of(past: str) -> str:
    return past.replace("past_key_values.", "present.", 1)


@dataclass(frozen=True)
class CacheShape:
    """One request's cache: `rows` sequences (beams included) of at most `capacity` tokens."""

    layout: GenerationRecord
    rows: int
    capacity: int
    dtype: np.dtype

    @property
    def pasts(self) -> list[str]:
        return [past_name(i, kind) for i in range(self.layout.layers) for kind in self.layout.layer_tensors(i)]

    @property
    def growing_pasts(self) -> list[str]:
        """The pasts with a sequence dim (keys and values; a state's size is fixed)."""
        return [name for name in self.pasts if name.rsplit(".", 1)[-1] not in self.layout.state_shapes]

    @property
    def state_pasts(self) -> list[str]:
        """The recurrent layers' states: a fixed size, replaced whole by every step."""
        growing = set(self.growing_pasts)
        return [name for name in self.pasts if name not in growing]

    def tensor_shape(self, name: str, length: int | None = None) -> tuple[int, ...]:
        """Past `name`'s [rows, kv_heads, length, last dim] (keys and values may differ in the last); the
        capacity by default. A state's [rows, *its fixed shape]."""
        layout, (layer, kind) = self.layout, name.rsplit(".", 2)[-2:]
        if kind in layout.state_shapes:
            return (self.rows, *layout.state_shapes[kind])
        length = self.capacity if length is None else length
        return (self.rows, layout.kv_heads, length, layout.last_dim(kind, int(layer)))

    def tensor_bytes(self, name: str) -> int:
        """Bytes of past (or present) `name` at the capacity."""
        return int(np.prod(self.tensor_shape(name))) * np.dtype(self.dtype).itemsize

    @property
    def reserved_bytes(self) -> dict[str, int]:
        """Every buffer a request needs at its longest: the pasts (each present shares its past's), the mask."""
        pasts = {name: self.tensor_bytes(name) for name in self.pasts}
        return {**pasts, "attention_mask": self.rows * self.capacity * 8}


@dataclass(frozen=True)
class StepFeeds:
    """What one step adds: `input_ids` and `position_ids` [rows, new], written from slot `write_index`, with
    `new_mask` [rows, new] (0 for a left-padding slot of the prompt, else 1)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    write_index: int
    new_mask: np.ndarray

    @property
    def new_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def token_feeds(self, positions: bool) -> dict[str, np.ndarray]:
        """input_ids, and position_ids where the graph reads them (`GenerationRecord.position_ids`)."""
        return {"input_ids": self.input_ids, **({"position_ids": self.position_ids} if positions else {})}


class CacheSession(abc.ABC):
    """A request's cache. `step` runs one step and returns the last position's logits [rows, vocab]; `reorder`
    makes row i a copy of row origin[i] (beam search); use as a context manager."""

    def __init__(self, shape: CacheShape) -> None:
        self.shape = shape

    @abc.abstractmethod
    def step(self, feeds: StepFeeds) -> np.ndarray: ...

    @abc.abstractmethod
    def reorder(self, origin: np.ndarray) -> None: ...

    def close(self) -> None:  # noqa: B027 - sessions with nothing to release need not override it
        """Release the request's buffers."""

    def __enter__(self) -> CacheSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _last_logits(logits: np.ndarray) -> np.ndarray:
    return logits[:, -1, :]


class DynamicCacheSession(CacheSession):
    """The dynamic layout: pasts that grow by the presents, a mask by the new columns."""

    def __init__(self, run: Run, shape: CacheShape) -> None:
        super().__init__(shape)
        self._run = run
        self.mask = np.zeros((shape.rows, 0), np.int64)
        self.cache = {name: np.zeros(shape.tensor_shape(name, 0), shape.dtype) for name in shape.pasts}

    def step(self, feeds: StepFeeds) -> np.ndarray:
        self.mask = np.concatenate([self.mask, feeds.new_mask.astype(np.int64)], axis=1)
        outputs = self._run(
            {**feeds.token_feeds(self.shape.layout.position_ids), "attention_mask": self.mask, **self.cache}
        )
        self.cache = {name: outputs[present_of(name)] for name in self.cache}
        return _last_logits(outputs["logits"])

    def reorder(self, origin: np.ndarray) -> None:
        self.cache = {name: value[origin] for name, value in self.cache.items()}
        self.mask = self.mask[origin]


class StaticCacheSession(CacheSession):
    """The static layout in host arrays: the pasts and the mask at the request's capacity, written in place.
    This class runs any backend's `run` and copies each present back into its past (the backend returned a new
    array); backends that can write the present into the past's buffer subclass it (`_run_step`)."""

    def __init__(self, run: Run, shape: CacheShape) -> None:
        super().__init__(shape)
        self._run = run
        self.mask = np.zeros((shape.rows, shape.capacity), np.int64)
        self.cache = {name: np.zeros(shape.tensor_shape(name), shape.dtype) for name in shape.pasts}

    def _small_feeds(self, feeds: StepFeeds) -> dict[str, np.ndarray]:
        """The step's own inputs; the mask's new columns are written first."""
        end = feeds.write_index + feeds.new_tokens
        if end > self.shape.capacity:
            raise ValueError(
                f"step writes slots {feeds.write_index}..{end - 1}, past the cache's {self.shape.capacity}"
            )
        self.mask[:, feeds.write_index : end] = feeds.new_mask
        write_indices = np.full(self.shape.rows, feeds.write_index, np.int64)
        return {**feeds.token_feeds(self.shape.layout.position_ids), WRITE_INDICES: write_indices}

    def step(self, feeds: StepFeeds) -> np.ndarray:
        return self._run_step(self._small_feeds(feeds))

    def _run_step(self, small: dict[str, np.ndarray]) -> np.ndarray:
        outputs = self._run({**small, "attention_mask": self.mask, **self.cache})
        for name, cache in self.cache.items():
            np.copyto(cache, outputs[present_of(name)])
        return _last_logits(outputs["logits"])

    def reorder(self, origin: np.ndarray) -> None:
        for cache in [*self.cache.values(), self.mask]:
            cache[...] = cache[origin]  # in place: bound buffers keep their addresses
