"""The CUDA runtime API as the TensorRT backend calls it: cuda-python's answers checked (`check_cuda`), and every
copy handed to it counted by direction (`CopyMeter`, `CopyCount`), so tests can hold the bytes a step copies to
what runtime/copy_plan.py lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, SupportsInt, TypeVar, overload

from tensorsmith.runtime.copy_plan import CopyPlan
from tensorsmith.runtime.errors import RuntimeLoadError

# cudaMemcpyKind values (cuda_runtime_api.h); cuda-python takes its enum: cudart.cudaMemcpyKind(value)
HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 1, 2, 3

Value = TypeVar("Value")
Done = tuple[SupportsInt]  # cuda-python's answer of a call that returns nothing: (cudaError_t,)
Pointer = int  # a device or pinned host address, as cuda-python gives and takes it


class MemcpyKinds(Protocol):
    """cuda-python's cudaMemcpyKind enum: a kind by value, or by name."""

    def __call__(self, value: int) -> SupportsInt: ...
    @property
    def cudaMemcpyHostToDevice(self) -> SupportsInt: ...
    @property
    def cudaMemcpyDeviceToHost(self) -> SupportsInt: ...


class CaptureModes(Protocol):
    """cuda-python's cudaStreamCaptureMode enum."""

    @property
    def cudaStreamCaptureModeThreadLocal(self) -> object: ...


class CudaRuntime(Protocol):
    """cuda-python's runtime module (cuda.bindings.runtime), as far as the TensorRT backend calls it. Streams and
    graphs are cuda-python's handles, only passed back to it (and to TensorRT)."""

    @property
    def cudaMemcpyKind(self) -> MemcpyKinds: ...
    @property
    def cudaStreamCaptureMode(self) -> CaptureModes: ...

    def cudaStreamCreate(self) -> tuple[SupportsInt, object]: ...
    def cudaStreamSynchronize(self, stream: object) -> Done: ...
    def cudaStreamDestroy(self, stream: object) -> Done: ...
    def cudaMalloc(self, size: int) -> tuple[SupportsInt, Pointer]: ...
    def cudaMallocHost(self, size: int) -> tuple[SupportsInt, Pointer]: ...
    def cudaFree(self, pointer: Pointer) -> Done: ...
    def cudaFreeHost(self, pointer: Pointer) -> Done: ...
    def cudaMemsetAsync(self, pointer: Pointer, value: int, count: int, stream: object) -> Done: ...
    def cudaMemcpyAsync(self, dst: Pointer, src: Pointer, count: int, kind: SupportsInt, stream: object) -> Done: ...
    def cudaMemcpy2DAsync(
        self,
        dst: Pointer,
        dpitch: int,
        src: Pointer,
        spitch: int,
        width: int,
        height: int,
        kind: SupportsInt,
        stream: object,
    ) -> Done: ...
    def cudaStreamBeginCapture(self, stream: object, mode: object) -> Done: ...
    def cudaStreamEndCapture(self, stream: object) -> tuple[SupportsInt, object]: ...
    def cudaGraphInstantiate(self, graph: object, flags: int) -> tuple[SupportsInt, object]: ...
    def cudaGraphLaunch(self, graph_exec: object, stream: object) -> Done: ...
    def cudaGraphDestroy(self, graph: object) -> Done: ...
    def cudaGraphExecDestroy(self, graph_exec: object) -> Done: ...


class MeteredCudaRuntime(CudaRuntime, Protocol):
    """The CUDA runtime with the bytes handed to its copies counted (`CopyMeter`)."""

    count: CopyCount


@overload
def check_cuda(result: Done, what: str) -> None: ...
@overload
def check_cuda(result: tuple[SupportsInt, Value], what: str) -> Value: ...
def check_cuda(result: object, what: str) -> object:
    """cuda-python's (error, *values) answer: the value(s), or RuntimeLoadError naming the call."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise RuntimeLoadError(f"CUDA error {error} in {what}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@dataclass(frozen=True)
class CopyCount:
    """Bytes handed to the CUDA API's copies, by direction, and how many copies."""

    to_device: int = 0
    to_host: int = 0
    on_device: int = 0
    copies: int = 0

    def __sub__(self, other: CopyCount) -> CopyCount:
        return CopyCount(
            self.to_device - other.to_device,
            self.to_host - other.to_host,
            self.on_device - other.on_device,
            self.copies - other.copies,
        )

    def agrees_with(self, plan: CopyPlan) -> bool:
        return (self.to_device, self.to_host, self.copies) == (
            plan.bytes_to_device,
            plan.bytes_to_host,
            len(plan.transfers),
        )


class CopyMeter:
    """cuda-python's runtime module, with every cudaMemcpyAsync and cudaMemcpy2DAsync counted (bytes by
    direction) as it is handed to CUDA; everything else passes through."""

    def __init__(self, cudart: CudaRuntime) -> None:
        self._cudart = cudart
        self.count = CopyCount()

    def __getattr__(self, name: str) -> Any:  # the rest of cuda-python's module, whatever it is
        return getattr(self._cudart, name)

    def _counted(self, kind: SupportsInt, nbytes: int) -> None:
        kind, count = int(kind), self.count
        self.count = CopyCount(
            count.to_device + nbytes * (kind == HOST_TO_DEVICE),
            count.to_host + nbytes * (kind == DEVICE_TO_HOST),
            count.on_device + nbytes * (kind == DEVICE_TO_DEVICE),
            count.copies + 1,
        )

    def cudaMemcpyAsync(self, dst: Pointer, src: Pointer, count: int, kind: SupportsInt, stream: object) -> Done:
        self._counted(kind, int(count))
        return self._cudart.cudaMemcpyAsync(dst, src, count, kind, stream)

    def cudaMemcpy2DAsync(
        self,
        dst: Pointer,
        dpitch: int,
        src: Pointer,
        spitch: int,
        width: int,
        height: int,
        kind: SupportsInt,
        stream: object,
    ) -> Done:
        self._counted(kind, int(width) * int(height))
        return self._cudart.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)
