"""The backend interface: public `run` checks the feeds, `_run_impl` does the work (Polygraphy's runner shape)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import numpy as np

from tensorsmith.runtime.kv_cache import CacheSession, CacheShape, DynamicCacheSession, StaticCacheSession, present_of
from tensorsmith.runtime.manifest import EngineRecord
from tensorsmith.runtime.slots import SlotCache
from tensorsmith.runtime.specs import Limits, TensorSpec, check_feeds, with_default_token_types


class Backend(abc.ABC):
    """One loaded model on one execution backend. Use as a context manager, or call `close()`."""

    #: e.g. "onnxruntime:CPUExecutionProvider" or "tensorrt:sm_89"
    name: str
    #: the record of the engine it runs (its profiles' batch limits); None: it runs an ONNX file
    engine: EngineRecord | None = None

    def __init__(
        self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], limits: Limits | None = None
    ) -> None:
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.limits = limits

    def run(self, feeds: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Run on `feeds` ({input name: array}); raises ValueError naming any input that does not fit its spec.
        `token_type_ids` may be left out, as transformers allows: they default to zeros."""
        return self._run_impl(check_feeds(with_default_token_types(feeds, self.inputs), self.inputs, self.limits))

    def run_checked_once(self) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """A run for a loop that builds its own feeds (generate): the first call is checked like `run`, the
        later ones go straight to the backend (their shapes grow from a checked first call)."""
        checked = False

        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            nonlocal checked
            if not checked:
                checked = True
                return self.run(feeds)
            return self._run_impl(feeds)

        return run

    def reserve(self, nbytes: dict[str, int]) -> None:  # noqa: B027 - a no-op unless the backend keeps buffers
        """Size the buffers of the named tensors for a whole request (generate: the cache at its longest), so
        that no step allocates. ONNX Runtime's CPU sessions allocate from their arena; binding preallocated
        outputs there was measured slower at every cache size (docs/benchmark-history.md), so this is a no-op."""

    def input_dtype(self, name: str) -> np.dtype:
        """The dtype this backend's graph takes for input `name`: the manifest's, unless the backend knows better
        (a GPU engine's static cache is fp16 where the manifest's fp32 graph has fp32)."""
        return np.dtype(next(spec.dtype for spec in self.inputs if spec.name == name))

    def open_cache(self, shape: CacheShape, static: bool) -> CacheSession:
        """A generation request's KV cache (runtime/kv_cache.py): in host arrays, fed to `run` each step, and for
        the static layout copied back from the presents. Backends that bind the cache in place or keep it on a
        device override this."""
        run = self.run_checked_once()
        if static:
            self.reserve(shape.reserved_bytes)
            return StaticCacheSession(run, shape)
        # the presents at their longest too: a dynamic cache's present is a new tensor each step
        self.reserve({**shape.reserved_bytes, **{present_of(name): shape.tensor_bytes(name) for name in shape.pasts}})
        return DynamicCacheSession(run, shape)

    def open_slots(self, shape: CacheShape) -> SlotCache:
        """The cache slots of a continuous-batching engine (runtime/slots.py): host arrays fed to `run`, the
        presents copied back. Backends that write in place override this."""
        self.reserve(shape.reserved_bytes)
        return SlotCache(self.run_checked_once(), shape)

    @abc.abstractmethod
    def _run_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None:  # noqa: B027 - backends without resources need not override it
        """Release the backend's resources."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
