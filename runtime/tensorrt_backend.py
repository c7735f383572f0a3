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
        self._context = self._engine.create_execution_context()
        self._stream = _check(self._cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: dict[str, tuple[int, int]] = {}  # name → (device pointer, bytes), grown on demand
        self._lock = threading.Lock()  # one execution context: one call at a time
        self.name = f"tensorrt:{target}"
        self._profile = {spec.name: self._engine.get_tensor_profile_shape(spec.name, 0) for spec in self.inputs}

    def _buffer(self, name: str, nbytes: int) -> int:
        pointer, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if pointer:
                _check(self._cudart.cudaFree(pointer), "cudaFree")
            pointer = _check(self._cudart.cudaMalloc(max(nbytes, 1)), "cudaMalloc")
            self._buffers[name] = (pointer, nbytes)
        return pointer

    def _check_profile(self, name: str, shape: tuple[int, ...]) -> None:
        low, _, high = (tuple(int(d) for d in bound) for bound in self._profile[name])
        if any(s < lo or s > hi for s, lo, hi in zip(shape, low, high, strict=True)):
            raise ValueError(f"input '{name}' has shape {list(shape)}, outside the engine's profile {low}..{high}")

    def _run_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        copy = self._cudart.cudaMemcpyKind
        with self._lock:
            for name, array in feeds.items():
                self._check_profile(name, array.shape)
                array = np.ascontiguousarray(array)
                pointer = self._buffer(name, array.nbytes)
                self._context.set_input_shape(name, array.shape)
                _check(
                    self._cudart.cudaMemcpyAsync(
                        pointer, array.ctypes.data, array.nbytes, copy.cudaMemcpyHostToDevice, self._stream
                    ),
                    "cudaMemcpyAsync",
                )
                self._context.set_tensor_address(name, pointer)
            results = {}
            for spec in self.outputs:
                shape = tuple(self._context.get_tensor_shape(spec.name))
                result = np.empty(shape, dtype=np.dtype(spec.dtype))
                pointer = self._buffer(spec.name, result.nbytes)
                self._context.set_tensor_address(spec.name, pointer)
                results[spec.name] = (result, pointer)
            if not self._context.execute_async_v3(self._stream):
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
