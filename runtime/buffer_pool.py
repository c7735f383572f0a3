"""A static-cache request's buffers (`DeviceBuffers`), and the pool that keeps the last request's for the next one
of the same sizes (`BufferPool`).

- on the device (cudaMalloc, zeroed with cudaMemsetAsync): every past, with its present bound to the same address,
  as TensorRT's KV-cache update (IKVCacheUpdateLayer, what its ONNX parser makes of TensorScatter) requires; the
  mask [rows, capacity]; each step's inputs and the last position's logits;
- pinned on the host (cudaMallocHost): each step's inputs staged for the copy, and the logits coming back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from tensorsmith.runtime.copy_plan import device_buffers, staging_bytes
from tensorsmith.runtime.cuda_graphs import DecodeGraph
from tensorsmith.runtime.cuda_runtime import CudaRuntime, check_cuda
from tensorsmith.runtime.errors import RuntimeLoadError
from tensorsmith.runtime.kv_cache import CacheShape


class DeviceBuffers:
    """A request's device buffers (`device_buffers`) and pinned host buffers (`staging_bytes`), by tensor name,
    with the decode graph captured over their addresses."""

    def __init__(self, cudart: CudaRuntime, shape: CacheShape, vocabulary: int, logits_dtype: np.dtype) -> None:
        self._cudart = cudart
        self.sizes = device_buffers(shape, vocabulary, logits_dtype)
        self.host_sizes = staging_bytes(shape, vocabulary, logits_dtype)
        self.key = (tuple(self.sizes.items()), tuple(self.host_sizes.items()))
        self.device: dict[str, int] = {}
        self.host: dict[str, int] = {}
        self.graph = DecodeGraph()
        self._scratch = (0, 0)  # (pointer, bytes): reorder's
        try:
            for name, size in self.sizes.items():
                self.device[name] = int(check_cuda(cudart.cudaMalloc(size), "cudaMalloc"))
            for name, size in self.host_sizes.items():
                self.host[name] = int(check_cuda(cudart.cudaMallocHost(size), "cudaMallocHost"))
        except RuntimeLoadError:
            self.free()
            raise

    def zero(self, stream: object) -> None:
        """Every device buffer to zeros (an empty cache, a mask of no slots), on the stream."""
        for name, pointer in self.device.items():
            check_cuda(self._cudart.cudaMemsetAsync(pointer, 0, self.sizes[name], stream), "cudaMemsetAsync")

    def host_view(self, name: str) -> np.ndarray:
        """The pinned buffer of `name` as bytes."""
        buffer = (ctypes.c_uint8 * self.host_sizes[name]).from_address(self.host[name])
        return np.ctypeslib.as_array(buffer)

    def scratch(self, nbytes: int) -> int:
        pointer, size = self._scratch
        if size < nbytes:
            if pointer:
                check_cuda(self._cudart.cudaFree(pointer), "cudaFree")
            pointer = int(check_cuda(self._cudart.cudaMalloc(nbytes), "cudaMalloc"))
            self._scratch = (pointer, nbytes)
        return pointer

    def free(self) -> None:
        self.graph.reset(self._cudart)
        for pointer in [*self.device.values(), self._scratch[0]]:
            if pointer:
                self._cudart.cudaFree(pointer)
        for pointer in self.host.values():
            self._cudart.cudaFreeHost(pointer)
        self.device, self.host, self._scratch = {}, {}, (0, 0)


class BufferPool:
    """The last finished request's buffers, kept for the next request of the same sizes (its decode graph
    with them); a request of other sizes frees them before allocating its own."""

    def __init__(self, cudart: CudaRuntime, forget: Callable[[object], None]) -> None:
        self._cudart = cudart
        self._forget = forget
        self._idle: DeviceBuffers | None = None
        self._closed = False

    @property
    def idle(self) -> DeviceBuffers | None:
        """The buffers kept for the next request, if any."""
        return self._idle

    def take(self, shape: CacheShape, vocabulary: int, logits_dtype: np.dtype, stream: object) -> DeviceBuffers:
        wanted = (
            tuple(device_buffers(shape, vocabulary, logits_dtype).items()),
            tuple(staging_bytes(shape, vocabulary, logits_dtype).items()),
        )
        buffers, self._idle = self._idle, None
        if buffers is not None and buffers.key != wanted:
            self._release(buffers)
            buffers = None
        if buffers is None:
            buffers = DeviceBuffers(self._cudart, shape, vocabulary, logits_dtype)
        buffers.zero(stream)
        return buffers

    def give_back(self, buffers: DeviceBuffers) -> None:
        if self._closed:  # the backend closed before the request did
            self._release(buffers)
            return
        if self._idle is not None:
            self._release(self._idle)
        self._idle = buffers

    def _release(self, buffers: DeviceBuffers) -> None:
        self._forget(buffers)
        buffers.free()

    def close(self) -> None:
        self._closed = True
        if self._idle is not None:
            self._release(self._idle)
            self._idle = None
