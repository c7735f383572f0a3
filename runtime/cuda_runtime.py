"""The CUDA runtime API as the TensorRT backend calls it: cuda-python's answers checked (`check_cuda`), and every
copy handed to it counted by direction (`CopyMeter`, `CopyCount`), so tests can hold the bytes a step copies to
what runtime/copy_plan.py lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorsmith.runtime.copy_plan import CopyPlan
from tensorsmith.runtime.errors import RuntimeLoadError

# cudaMemcpyKind values (cuda_runtime_api.h); cuda-python takes its enum: cudart.cudaMemcpyKind(value)
HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 1, 2, 3


def check_cuda(result: Any, what: str) -> Any:
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

    def __init__(self, cudart: Any) -> None:
        self._cudart = cudart
        self.count = CopyCount()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cudart, name)

    def _counted(self, kind: Any, nbytes: int) -> None:
        kind, count = int(kind), self.count
        self.count = CopyCount(
            count.to_device + nbytes * (kind == HOST_TO_DEVICE),
            count.to_host + nbytes * (kind == DEVICE_TO_HOST),
            count.on_device + nbytes * (kind == DEVICE_TO_DEVICE),
            count.copies + 1,
        )

    def cudaMemcpyAsync(self, dst: Any, src: Any, count: int, kind: Any, stream: Any) -> Any:
        self._counted(kind, int(count))
        return self._cudart.cudaMemcpyAsync(dst, src, count, kind, stream)

    def cudaMemcpy2DAsync(
        self,
        dst: Any,
        dpitch: int,
        src: Any,
        spitch: int,
        width: int,
        height: int,
        kind: Any,
        stream: Any,
    ) -> Any:
        self._counted(kind, int(width) * int(height))
        return self._cudart.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)
