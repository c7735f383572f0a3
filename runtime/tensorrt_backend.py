"""TensorRT backend: deserialize an engine (tensorrt or tensorrt_rtx) and run it with dynamic shapes.

Device buffers and a CUDA stream come from cuda-python; inputs and outputs are numpy arrays. `run` copies every
input in and every output back; generation over a static-cache engine keeps the cache on the device instead
(`open_cache`: runtime/tensorrt_cache.py, copying what runtime/copy_plan.py lists). Needs a GPU, so its tests
are marked `gpu` and run from scripts/gpu-check.sh.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tensorsmith.runtime.artifact import Artifact
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.buffer_pool import BufferPool
from tensorsmith.runtime.cuda_runtime import CopyMeter, CudaRuntime, MeteredCudaRuntime, check_cuda
from tensorsmith.runtime.device import FLAVOURS
from tensorsmith.runtime.errors import BackendUnavailable, RuntimeLoadError
from tensorsmith.runtime.kv_cache import CacheSession, CacheShape
from tensorsmith.runtime.selection import select_engine
from tensorsmith.runtime.specs import TensorSpec
from tensorsmith.runtime.tensorrt_cache import CacheRuntime, TensorRTStaticCache
from tensorsmith.runtime.tensorrt_engine import Bounds, EngineContexts, EngineIO, ExecutionContext, engine_io

logger = logging.getLogger(__name__)


def _cudart() -> CudaRuntime:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as err:
            raise RuntimeLoadError("the TensorRT backend needs cuda-python", hint="pip install cuda-python") from err
    return cudart


def uses_own_cuda_graphs(flavour: str) -> bool:
    """TensorRT for RTX captures CUDA graphs itself (a runtime config's `cuda_graph_strategy`); data-centre
    TensorRT's are captured around `execute_async_v3` by the caller."""
    return flavour == "tensorrt-rtx"


def open_backend(artifact: Artifact) -> TensorRTBackend:
    """The artifact's engine for this device (runtime/selection.py says which, or why none)."""
    selection = select_engine(artifact.manifest, artifact.device, artifact.directory)
    if selection.target is None or selection.path is None:
        raise BackendUnavailable(selection.reason, hint="use backend='auto'")
    target = selection.target
    backend = TensorRTBackend(selection.path, target.builder, target.name, artifact.inputs, artifact.outputs)
    backend.engine = target.engine
    return backend


class TensorRTBackend(Backend):
    def __init__(
        self, engine_path: Path, flavour: str, target: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
    ) -> None:
        super().__init__(inputs, outputs)
        trt = importlib.import_module(FLAVOURS[flavour][0])
        self._cudart: MeteredCudaRuntime = CopyMeter(_cudart())  # every copy counted, as it is handed to CUDA
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self._engine is None:
            raise RuntimeLoadError(
                f"{flavour} could not deserialize {engine_path}",
                hint="the engine was built for another GPU or TensorRT version; rebuild it with tensorsmith build",
            )
        self._trt = trt
        self._flavour = flavour
        self._stream = check_cuda(self._cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: dict[str, tuple[int, int]] = {}  # name → (device pointer, bytes), grown on demand
        self._lock = threading.Lock()  # one call at a time: the buffers, contexts and stream are shared
        self.name = f"tensorrt:{target}"
        # Each optimization profile (a decoder's prefill and decode) gets an execution context of its own, made
        # when a call first needs it; a call runs on the first profile its shapes fit.
        self._profiles: list[dict[str, Bounds]] = [
            {spec.name: self._profile_bounds(spec.name, k) for spec in self.inputs}
            for k in range(self._engine.num_optimization_profiles)
        ]
        # a decoder built from the static-cache graph: generation keeps its cache on the device
        self._cache_io: EngineIO | None = engine_io(self._engine, trt, self._profiles)
        self._contexts = EngineContexts(self._profiles, self._create_context)
        self._cache_runtime: CacheRuntime | None = None

    def _buffer(self, name: str, nbytes: int) -> int:
        """The device buffer of `name`, at least `nbytes`; grown by doubling, so a tensor that grows one token per
        call (a cache without `reserve`) reallocates a handful of times, not every call."""
        pointer, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if pointer:
                check_cuda(self._cudart.cudaFree(pointer), "cudaFree")
            size = max(nbytes, 2 * size, 1)
            pointer = check_cuda(self._cudart.cudaMalloc(size), "cudaMalloc")
            self._buffers[name] = (pointer, size)
        return pointer

    def reserve(self, nbytes: dict[str, int]) -> None:
        """Device buffers for a whole request (a decoder's cache at its longest), made before its first step."""
        with self._lock:
            for name, size in nbytes.items():
                self._buffer(name, size)

    def _profile_bounds(self, name: str, index: int) -> Bounds:
        """(min, opt, max) of input `name` in optimization profile `index`."""
        low, best, high = (tuple(int(d) for d in bound) for bound in self._engine.get_tensor_profile_shape(name, index))
        return low, best, high

    def _create_context(self, index: int) -> ExecutionContext:
        """Profile `index`'s execution context. On TensorRT for RTX the decode profile of a static-cache engine
        gets TensorRT's own CUDA graphs (captured per shape, launched for every later step of that shape)."""
        graphed = self._cache_io is not None and index == self._cache_io.graph_profile
        if graphed and uses_own_cuda_graphs(self._flavour):
            config = self._engine.create_runtime_config()
            config.cuda_graph_strategy = self._trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
            context = self._engine.create_execution_context(config)
        else:
            context = self._engine.create_execution_context()
        if index:
            context.set_optimization_profile_async(index, self._stream)
        return context

    def _context(self, shapes: dict[str, tuple[int, ...]]) -> ExecutionContext:
        """The execution context of the first profile that `shapes` fit, made on first use."""
        return self._contexts.get(shapes)[1]

    def open_cache(self, shape: CacheShape, static: bool) -> CacheSession:
        """The static cache on the device for the whole request (runtime/tensorrt_cache.py); the dynamic one
        as every backend's, through `run`."""
        if not static or self._cache_io is None:
            return super().open_cache(shape, static)
        if self._cache_runtime is None:
            self._cache_runtime = CacheRuntime(
                io=self._cache_io,
                contexts=self._contexts,
                cudart=self._cudart,
                stream=self._stream,
                lock=self._lock,
                pool=BufferPool(self._cudart, self._contexts.forget),
                explicit_graphs=not uses_own_cuda_graphs(self._flavour),
            )
        return TensorRTStaticCache(self._cache_runtime, shape)

    def _run_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        copy = self._cudart.cudaMemcpyKind
        with self._lock:
            context = self._context({name: tuple(array.shape) for name, array in feeds.items()})
            for name, array in feeds.items():
                array = np.ascontiguousarray(array)
                pointer = self._buffer(name, array.nbytes)
                context.set_input_shape(name, array.shape)
                check_cuda(
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
                check_cuda(
                    self._cudart.cudaMemcpyAsync(
                        result.ctypes.data, pointer, result.nbytes, copy.cudaMemcpyDeviceToHost, self._stream
                    ),
                    "cudaMemcpyAsync",
                )
            check_cuda(self._cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
            return {name: result for name, (result, _) in results.items()}

    def close(self) -> None:
        with self._lock:
            if self._cache_runtime is not None:
                self._cache_runtime.pool.close()
                self._cache_runtime = None
            self._contexts.close()
        for pointer, _ in self._buffers.values():
            self._cudart.cudaFree(pointer)
        self._buffers.clear()
        if getattr(self, "_stream", None) is not None:
            self._cudart.cudaStreamDestroy(self._stream)
            self._stream = None
