"""The static KV cache on a TensorRT engine, kept on the device for the whole request (issue 25): the session,
`TensorRTStaticCache`.

A request's buffers (runtime/buffer_pool.py) are made once, or taken over from the last request with the same
sizes: the caches, the mask, each step's inputs and the logits on the device, and pinned host buffers staging
the inputs and taking the logits back.

A step, on the backend's one stream: the copies runtime/copy_plan.py's `step_copies` lists (the mask's new columns
by cudaMemcpy2DAsync into the device mask at the write index), the engine, the logits back, and one
cudaStreamSynchronize, before the host reads them. The session iterates the plan's entries: it copies what the
plan says and nothing else, and counts the bytes it hands to the CUDA API (`CopyMeter`, runtime/cuda_runtime.py)
so tests can hold the two to each other.

The decode step runs as a CUDA graph: TensorRT for RTX captures it itself; on data-centre TensorRT the session
captures it after one warm-up step and launches it for every later decode step (`DecodeGraph`,
runtime/cuda_graphs.py).

The session's capacity is the engine's static cache length (runtime/tensorrt_engine.py), at least the request's.
Beam search's `reorder` gathers rows on the device: each moved row is copied device to device into a scratch
buffer and back, so the buffers keep their addresses (and the graph stays valid).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tensorsmith.runtime.buffer_pool import BufferPool, DeviceBuffers
from tensorsmith.runtime.copy_plan import LOGITS, MASK, CopyPlan, Transfer, step_copies
from tensorsmith.runtime.cuda_graphs import DecodeGraph, execute
from tensorsmith.runtime.cuda_runtime import (
    DEVICE_TO_DEVICE,
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    CopyCount,
    MeteredCudaRuntime,
    check_cuda,
)
from tensorsmith.runtime.errors import InferenceError
from tensorsmith.runtime.kv_cache import WRITE_INDICES, CacheSession, CacheShape, StepFeeds, present_of
from tensorsmith.runtime.tensorrt_engine import EngineContexts, EngineIO, ExecutionContext, Shapes

# ---------------------------------------------------------------------------------------------------------------
# The shapes of a step, the rows a reorder moves.


def step_shapes(shape: CacheShape, new_tokens: int) -> Shapes:
    """Every input's shape for a step of `new_tokens` tokens."""
    rows = shape.rows
    return {
        "input_ids": (rows, new_tokens),
        **({"position_ids": (rows, new_tokens)} if shape.layout.position_ids else {}),
        MASK: (rows, shape.capacity),
        WRITE_INDICES: (rows,),
        **{name: shape.tensor_shape(name) for name in shape.pasts},
    }


def moved_rows(origin: np.ndarray) -> list[tuple[int, int]]:
    """(destination, source) of every row a reorder changes (row i becomes a copy of row origin[i])."""
    return [(row, int(source)) for row, source in enumerate(np.asarray(origin).reshape(-1)) if int(source) != row]


@dataclass
class CacheRuntime:
    """The backend's side of its static-cache sessions: the engine's I/O, its contexts, the CUDA API (metered),
    one stream, the lock that keeps one call at a time on them, and the buffer pool. `explicit_graphs`: capture
    the decode step here (data-centre TensorRT); TensorRT for RTX captures its own."""

    io: EngineIO
    contexts: EngineContexts
    cudart: MeteredCudaRuntime
    stream: object  # cuda-python's cudaStream_t
    lock: threading.Lock
    pool: BufferPool
    explicit_graphs: bool


# ---------------------------------------------------------------------------------------------------------------
# The session.


class TensorRTStaticCache(CacheSession):
    """A request's static cache on the device; `copies` holds what each step handed to the CUDA API's copies."""

    def __init__(self, runtime: CacheRuntime, shape: CacheShape) -> None:
        super().__init__(runtime.io.session_shape(shape))
        runtime.io.check_aliases(self.shape.pasts)
        self._runtime = runtime
        self._plans: dict[int, CopyPlan] = {}
        self.copies: list[CopyCount] = []
        self.reorder_copies = CopyCount()
        with runtime.lock:
            self._buffers: DeviceBuffers | None = runtime.pool.take(
                self.shape, runtime.io.vocabulary, runtime.io.logits_dtype, runtime.stream
            )
        self._graph = self._buffers.graph

    def plan(self, new_tokens: int) -> CopyPlan:
        """What a step of `new_tokens` tokens copies: what `step` does."""
        if new_tokens not in self._plans:
            io = self._runtime.io
            self._plans[new_tokens] = step_copies(self.shape, new_tokens, io.vocabulary, io.logits_dtype)
        return self._plans[new_tokens]

    @property
    def graph(self) -> DecodeGraph:
        """The decode step's graph (data-centre TensorRT's), kept with the buffers: readable after `close`."""
        return self._graph

    def _live(self) -> DeviceBuffers:
        if self._buffers is None:
            raise InferenceError("the generation request's cache is closed")
        return self._buffers

    def step(self, feeds: StepFeeds) -> np.ndarray:
        end = feeds.write_index + feeds.new_tokens
        if end > self.shape.capacity:
            raise ValueError(
                f"step writes slots {feeds.write_index}..{end - 1}, past the cache's {self.shape.capacity}"
            )
        plan = self.plan(feeds.new_tokens)
        values = {
            **feeds.token_feeds(self.shape.layout.position_ids),
            MASK: feeds.new_mask,
            WRITE_INDICES: np.full(self.shape.rows, feeds.write_index, np.int64),
        }
        runtime, buffers = self._runtime, self._live()
        with runtime.lock:
            before = runtime.cudart.count
            for transfer in plan.to_device:
                self._send(buffers, transfer, values[transfer.tensor], feeds.write_index)
            self._execute(buffers, step_shapes(self.shape, feeds.new_tokens))
            for transfer in plan.to_host:
                check_cuda(
                    runtime.cudart.cudaMemcpyAsync(
                        buffers.host[transfer.tensor],
                        buffers.device[transfer.tensor],
                        transfer.nbytes,
                        runtime.cudart.cudaMemcpyKind(DEVICE_TO_HOST),
                        runtime.stream,
                    ),
                    "cudaMemcpyAsync",
                )
            check_cuda(runtime.cudart.cudaStreamSynchronize(runtime.stream), "cudaStreamSynchronize")
            self.copies.append(runtime.cudart.count - before)
            logits = buffers.host_view(LOGITS)[: plan.by_tensor()[LOGITS]]
            return logits.view(runtime.io.logits_dtype).reshape(self.shape.rows, runtime.io.vocabulary).copy()

    def _send(self, buffers: DeviceBuffers, transfer: Transfer, value: np.ndarray, write_index: int) -> None:
        data = np.ascontiguousarray(value, dtype=np.int64)
        if data.nbytes != transfer.nbytes:
            raise ValueError(f"{transfer.tensor}: {data.nbytes} bytes this step, the plan says {transfer.nbytes}")
        buffers.host_view(transfer.tensor)[: data.nbytes] = data.reshape(-1).view(np.uint8)
        layout = transfer.layout(write_index)
        device, host = buffers.device[transfer.tensor] + layout.device_offset, buffers.host[transfer.tensor]
        cudart, stream = self._runtime.cudart, self._runtime.stream
        if transfer.pitched:
            check_cuda(
                cudart.cudaMemcpy2DAsync(
                    device,
                    layout.device_pitch,
                    host,
                    layout.host_pitch,
                    layout.width,
                    layout.height,
                    cudart.cudaMemcpyKind(HOST_TO_DEVICE),
                    stream,
                ),
                "cudaMemcpy2DAsync",
            )
        else:
            check_cuda(
                cudart.cudaMemcpyAsync(device, host, transfer.nbytes, cudart.cudaMemcpyKind(HOST_TO_DEVICE), stream),
                "cudaMemcpyAsync",
            )

    def _execute(self, buffers: DeviceBuffers, shapes: Shapes) -> None:
        runtime = self._runtime
        index, context, stale = runtime.contexts.get(shapes, owner=buffers)
        graphed = runtime.explicit_graphs and index == runtime.io.graph_profile
        if stale:
            self._bind(context, buffers, shapes)
            if graphed:
                buffers.graph.reset(runtime.cudart)
        if graphed:
            buffers.graph.run(context, runtime.cudart, runtime.stream)
        else:
            execute(context, runtime.stream)

    def _bind(self, context: ExecutionContext, buffers: DeviceBuffers, shapes: Shapes) -> None:
        for name, dims in shapes.items():
            if not context.set_input_shape(name, dims):
                raise InferenceError(f"TensorRT refused the shape {list(dims)} for {name}")
            context.set_tensor_address(name, buffers.device[name])
        for past in self.shape.pasts:
            context.set_tensor_address(present_of(past), buffers.device[past])  # aliased: updated in place
        context.set_tensor_address(LOGITS, buffers.device[LOGITS])

    def reorder(self, origin: np.ndarray) -> None:
        """Row i becomes a copy of row origin[i], on the device: the moved rows gathered into a scratch buffer,
        then copied back over their rows (the buffers keep their addresses)."""
        origin = np.asarray(origin).reshape(-1)
        if len(origin) != self.shape.rows:
            raise ValueError(f"reorder got {len(origin)} rows for a cache of {self.shape.rows}")
        moves = moved_rows(origin)
        if not moves:
            return
        runtime, buffers = self._runtime, self._live()
        with runtime.lock:
            before = runtime.cudart.count
            names = [*self.shape.pasts, MASK]
            scratch = buffers.scratch(max(buffers.sizes[name] for name in names) // self.shape.rows * len(moves))
            for name in names:
                row_bytes, base = buffers.sizes[name] // self.shape.rows, buffers.device[name]
                for slot, (_, source) in enumerate(moves):
                    self._on_device(scratch + slot * row_bytes, base + source * row_bytes, row_bytes)
                for slot, (destination, _) in enumerate(moves):
                    self._on_device(base + destination * row_bytes, scratch + slot * row_bytes, row_bytes)
            self.reorder_copies = runtime.cudart.count - before

    def _on_device(self, destination: int, source: int, nbytes: int) -> None:
        runtime = self._runtime
        kind = runtime.cudart.cudaMemcpyKind(DEVICE_TO_DEVICE)
        check_cuda(runtime.cudart.cudaMemcpyAsync(destination, source, nbytes, kind, runtime.stream), "cudaMemcpyAsync")

    def close(self) -> None:
        if self._buffers is None:
            return
        with self._runtime.lock:
            self._runtime.pool.give_back(self._buffers)
        self._buffers = None
