"""A TensorRT engine as a static-cache session sees it: which optimization profile a step's shapes fit, the
engine's cache I/O (`EngineIO`, read by `engine_io`) and one execution context per profile (`EngineContexts`).

TensorRT's KV-cache update needs a static cache length (its parser refuses TensorScatter into a cache whose
sequence dim is dynamic), so a session's capacity is the engine's (`EngineIO.capacity`), at least the request's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from tensorsmith.runtime.copy_plan import LOGITS
from tensorsmith.runtime.errors import RuntimeLoadError
from tensorsmith.runtime.kv_cache import WRITE_INDICES, CacheShape, present_of

logger = logging.getLogger(__name__)

Bounds = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # an input's (min, opt, max) in a profile
Shapes = dict[str, tuple[int, ...]]
PAST_PREFIX = "past_key_values."


# ---------------------------------------------------------------------------------------------------------------
# What is asked of TensorRT, the same on data-centre TensorRT and on TensorRT for RTX (two modules).


class ExecutionContext(Protocol):
    """TensorRT's IExecutionContext; a stream is cuda-python's handle."""

    def set_optimization_profile_async(self, index: int, stream: object) -> bool: ...
    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool: ...
    def set_tensor_address(self, name: str, memory: int) -> bool: ...
    def get_tensor_shape(self, name: str) -> Iterable[int]: ...
    def execute_async_v3(self, stream: object) -> bool: ...


class EngineTensors(Protocol):
    """TensorRT's ICudaEngine, as far as its I/O tensors go; a tensor's dtype is TensorRT's DataType."""

    @property
    def num_io_tensors(self) -> int: ...
    def get_tensor_name(self, index: int) -> str: ...
    def get_tensor_shape(self, name: str) -> Iterable[int]: ...
    def get_tensor_dtype(self, name: str) -> object: ...


class TensorTypes(Protocol):
    """The tensorrt module's numpy type of a DataType."""

    def nptype(self, trt_type: object) -> DTypeLike: ...


# ---------------------------------------------------------------------------------------------------------------
# Which profile a step's shapes fit, and the session's capacity.


def fitting_profile(profiles: Sequence[Mapping[str, Bounds]], shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The first optimization profile whose (min, max) hold every shape in `shapes`; None if none does."""
    for index, profile in enumerate(profiles):
        if all(
            len(shape) == len(profile[name][0])
            and all(lo <= size <= hi for size, lo, hi in zip(shape, profile[name][0], profile[name][2], strict=True))
            for name, shape in shapes.items()
        ):
            return index
    return None


def misfit_message(profiles: Sequence[Mapping[str, Bounds]], shapes: Mapping[str, tuple[int, ...]]) -> str:
    ranges = "; ".join(
        ", ".join(f"{name} {list(b[0])}..{list(b[2])}" for name, b in profile.items()) for profile in profiles
    )
    described = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
    return f"inputs {described} fit none of the engine's profiles ({ranges})"


def decode_profile(profiles: Sequence[Mapping[str, Bounds]]) -> int | None:
    """The profile of one-token steps (input_ids' sequence at most 1): the one a CUDA graph serves."""
    for index, profile in enumerate(profiles):
        bounds = profile.get("input_ids")
        if bounds is not None and len(bounds[2]) == 2 and bounds[2][1] == 1:
            return index
    return None


def capacity_for(engine_capacity: int | None, requested: int) -> int:
    """The session's cache length: the engine's where it is static (TensorRT's KV-cache update needs it so),
    else the request's."""
    if engine_capacity is None:
        return requested
    if requested > engine_capacity:
        raise ValueError(f"the request needs {requested} cache slots; the engine's cache holds {engine_capacity}")
    return engine_capacity


@dataclass(frozen=True)
class EngineIO:
    """What a static-cache session needs to know of the engine: the vocabulary and the logits' dtype, the caches'
    dtype and static length (None where the cache dim is dynamic), the profiles, and what TensorRT says each
    present aliases (None: no alias, or a TensorRT without `get_aliased_input_tensor`)."""

    vocabulary: int
    logits_dtype: np.dtype
    cache_dtype: np.dtype
    capacity: int | None
    profiles: tuple[Mapping[str, Bounds], ...]
    aliases: Mapping[str, str | None] = dataclasses.field(default_factory=dict)

    def session_shape(self, shape: CacheShape) -> CacheShape:
        """The request's shape as the engine holds it: its cache length and dtype (the host never reads the
        caches, so the engine's dtype is the one that counts)."""
        if np.dtype(shape.dtype) != self.cache_dtype:
            logger.debug("the cache is %s on the engine (the artifact says %s)", self.cache_dtype, shape.dtype)
        return dataclasses.replace(shape, capacity=capacity_for(self.capacity, shape.capacity), dtype=self.cache_dtype)

    def check_aliases(self, pasts: Sequence[str]) -> None:
        for past in pasts:
            aliased = self.aliases.get(present_of(past))
            if aliased is not None and aliased != past:
                raise RuntimeLoadError(
                    f"the engine aliases {present_of(past)} to {aliased}, not {past}",
                    hint="rebuild the engine from the static-cache graph",
                )

    @property
    def graph_profile(self) -> int | None:
        """The profile whose steps a CUDA graph serves: decode, where the cache length is static (a dynamic one
        would need a graph per past length)."""
        return decode_profile(self.profiles) if self.capacity is not None else None


def _host_dtype(trt: TensorTypes, dtype: object) -> np.dtype:
    """numpy's type for a TensorRT one; bfloat16, which numpy has not, as its 2-byte stand-in (the host only
    sizes the caches, it never reads them)."""
    try:
        return np.dtype(trt.nptype(dtype))
    except TypeError:
        return np.dtype(np.uint16)


def engine_io(engine: EngineTensors, trt: TensorTypes, profiles: Sequence[Mapping[str, Bounds]]) -> EngineIO | None:
    """`engine`'s static-cache I/O; None unless it is a decoder with past_key_values inputs and logits."""
    names = [engine.get_tensor_name(index) for index in range(engine.num_io_tensors)]
    pasts = [name for name in names if name.startswith(PAST_PREFIX)]
    if not pasts or LOGITS not in names or WRITE_INDICES not in names:
        return None
    length = int(list(engine.get_tensor_shape(pasts[0]))[2])
    aliased = getattr(engine, "get_aliased_input_tensor", None)
    return EngineIO(
        vocabulary=int(list(engine.get_tensor_shape(LOGITS))[-1]),
        logits_dtype=np.dtype(trt.nptype(engine.get_tensor_dtype(LOGITS))),
        cache_dtype=_host_dtype(trt, engine.get_tensor_dtype(pasts[0])),
        capacity=length if length > 0 else None,
        profiles=tuple(profiles),
        aliases={present_of(past): aliased(present_of(past)) if aliased else None for past in pasts},
    )


class EngineContexts:
    """One execution context per optimization profile, made on first use and shared by the backend's `run` and
    its cache sessions, with who bound each one's shapes and addresses last (so a session binds only when
    something else did since: its decode context is bound once for the buffers' life)."""

    def __init__(self, profiles: Sequence[Mapping[str, Bounds]], create: Callable[[int], ExecutionContext]) -> None:
        self.profiles = list(profiles)
        self._create = create
        self._contexts: dict[int, ExecutionContext] = {}
        self._bound: dict[int, tuple[object, Shapes]] = {}

    def get(
        self, shapes: Mapping[str, tuple[int, ...]], owner: object | None = None
    ) -> tuple[int, ExecutionContext, bool]:
        """(profile index, context, whether the caller must bind it): `owner` None binds every time (`run`)."""
        index = fitting_profile(self.profiles, shapes)
        if index is None:
            raise ValueError(misfit_message(self.profiles, shapes))
        if index not in self._contexts:
            self._contexts[index] = self._create(index)
        previous = self._bound.get(index)
        stale = owner is None or previous is None or previous[0] is not owner or previous[1] != dict(shapes)
        self._bound[index] = (owner, dict(shapes))
        return index, self._contexts[index], stale

    def forget(self, owner: object) -> None:
        """`owner`'s buffers are gone: the contexts bound to them must be bound again."""
        self._bound = {index: bound for index, bound in self._bound.items() if bound[0] is not owner}

    def close(self) -> None:
        self._contexts.clear()
        self._bound.clear()
