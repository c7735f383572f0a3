"""TensorRT backend: deserialize an engine (tensorrt or tensorrt_rtx) and run it with dynamic shapes.

Device buffers and a CUDA stream come from cuda-python; inputs and outputs are numpy arrays. Needs a GPU, so
its tests are marked `gpu` and run from scripts/gpu-check.sh.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.device import FLAVOURS
from tensorsmith.runtime.errors import RuntimeLoadError
from tensorsmith.runtime.specs import TensorSpec

logger = logging.getLogger(__name__)


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as err:
            raise RuntimeLoadError("the TensorRT backend needs cuda-python", hint="pip install cuda-python") from err
    return cudart


def _check(result: Any, what: str) -> Any:
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise RuntimeLoadError(f"CUDA error {error} in {what}")
    return values[0] if len(values) == 1 else values


class TensorRTBackend(Backend):
    def __init__(
        self, engine_path: Path, flavour: str, target: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
    ) -> None:
        super().__init__(inputs, outputs)
        trt = importlib.import_module(FLAVOURS[flavour][0])
        self._cudart = _cudart()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self._engine is None:
            raise RuntimeLoadError(
                f"{flavour} could not deserialize {engine_path}",
                hint="the engine was built for another GPU or TensorRT version; rebuild it with tensorsmith build",
            )
        self._stream = _check(self._cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: dict[str, tuple[int, int]] = {}  # name → (device pointer, bytes), grown on demand
        self._lock = threading.Lock()  # one call at a time: the buffers are shared
        self.name = f"tensorrt:{target}"
        # Each optimization profile (a decoder's prefill and decode) gets an execution context of its own, made
        # when a call first needs it; a call runs on the first profile its shapes fit.
        self._profiles = [
            {spec.name: self._profile_bounds(spec.name, k) for spec in self.inputs}
            for k in range(self._engine.num_optimization_profiles)
        ]
        self._contexts: dict[int, Any] = {}

    def _buffer(self, name: str, nbytes: int) -> int:
        """The device buffer of `name`, at least `nbytes`; grown by doubling, so a tensor that grows one token per
        call (a cache without `reserve`) reallocates a handful of times, not every call."""
        pointer, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if pointer:
                _check(self._cudart.cudaFree(pointer), "cudaFree")
            size = max(nbytes, 2 * size, 1)
            pointer = _check(self._cudart.cudaMalloc(size), "cudaMalloc")
            self._buffers[name] = (pointer, size)
        return pointer

    def reserve(self, nbytes: dict[str, int]) -> None:
        """Device buffers for a whole request (a decoder's cache at its longest), made before its first step."""
        with self._lock:
            for name, size in nbytes.items():
                self._buffer(name, size)

    def _profile_bounds(self, name: str, index: int) -> tuple[tuple[int, ...], ...]:
        """(min, opt, max) of input `name` in optimization profile `index`."""
        return tuple(tuple(int(d) for d in bound) for bound in self._engine.get_tensor_profile_shape(name, index))

    def _context(self, shapes: dict[str, tuple[int, ...]]) -> Any:
        """The execution context of the first profile that `shapes` fit, made on first use."""
        for index, profile in enumerate(self._profiles):
            fits = all(
                all(lo <= s <= hi for s, lo, hi in zip(shape, profile[name][0], profile[name][2], strict=True))
                for name, shape in shapes.items()
            )
            if fits:
                if index not in self._contexts:
                    context = self._engine.create_execution_context()
                    if index:
                        context.set_optimization_profile_async(index, self._stream)
                    self._contexts[index] = context
                return self._contexts[index]
        ranges = "; ".join(
            ", ".join(f"{name} {list(b[0])}..{list(b[2])}" for name, b in profile.items()) for profile in self._profiles
        )
        described = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"inputs {described} fit none of the engine's profiles ({ranges})")

    def _run_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        copy = self._cudart.cudaMemcpyKind
        with self._lock:
            context = self._context({name: tuple(array.shape) for name, array in feeds.items()})
            for name, array in feeds.items():
                array = np.ascontiguousarray(array)
                pointer = self._buffer(name, array.nbytes)
                context.set_input_shape(name, array.shape)
                _check(
                    self._cudart.cudaMemcpyAsync(
                        pointer, array.ctypes.data, array.nbytes, copy.cudaMemcpyHostToDevice, self._stream
                    ),
                    "cudaMemcpyAsync",
                )
                context.set_tensor_address(name, pointer)
            results = {}
            for spec in self.outputs:
                shape = tuple(context.get_tensor_shape(spec.name))
                result = np.empty(shape, dtype=np.dtype(spec.dtype))
                pointer = self._buffer(spec.name, result.nbytes)
                context.set_tensor_address(spec.name, pointer)
                results[spec.name] = (result, pointer)
            if not context.execute_async_v3(self._stream):
                raise RuntimeLoadError("TensorRT failed to execute the engine")
            for result, pointer in results.values():
                _check(
                    self._cudart.cudaMemcpyAsync(
                        result.ctypes.data, pointer, result.nbytes, copy.cudaMemcpyDeviceToHost, self._stream
                    ),
                    "cudaMemcpyAsync",
                )
            _check(self._cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
            return {name: result for name, (result, _) in results.items()}

    def close(self) -> None:
        for pointer, _ in self._buffers.values():
            self._cudart.cudaFree(pointer)
        self._buffers.clear()
        if getattr(self, "_stream", None) is not None:
            self._cudart.cudaStreamDestroy(self._stream)
            self._stream = None
