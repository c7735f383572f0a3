"""The decode step of a static-cache session as a CUDA graph, on data-centre TensorRT (`DecodeGraph`).

TensorRT for RTX captures the graph itself (the decode profile's context is made with `cuda_graph_strategy =
WHOLE_GRAPH_CAPTURE`); on data-centre TensorRT the session captures `execute_async_v3` (cudaStreamBeginCapture,
cudaStreamEndCapture, cudaGraphInstantiate) after one warm-up step and launches the graph for every later decode
step. The tensor addresses are fixed for the buffers' life and each step's values are copied into those buffers
before the launch, so one graph serves every decode step of every request with these buffers; it is captured again
only for new buffers (another batch size) or after something else bound the context's addresses.
"""

from __future__ import annotations

import logging

from tensorsmith.runtime.cuda_runtime import CudaRuntime, check_cuda
from tensorsmith.runtime.errors import InferenceError
from tensorsmith.runtime.tensorrt_engine import ExecutionContext

logger = logging.getLogger(__name__)


class DecodeGraph:
    """Data-centre TensorRT's decode step as a CUDA graph: executed once to warm up (TensorRT finishes its
    shape-dependent set-up on the first enqueue), captured on the next step, launched from then on. A capture
    that fails (a context that is not capturable) leaves the step executed as it is."""

    def __init__(self) -> None:
        self.warmed = False
        self.failed = False
        self.captures = 0
        self.launches = 0
        self._graph: object = None  # cuda-python's cudaGraph_t and cudaGraphExec_t
        self._exec: object = None

    def next_action(self) -> str:
        if self._exec is not None:
            return "launch"
        return "execute" if self.failed or not self.warmed else "capture"

    def run(self, context: ExecutionContext, cudart: CudaRuntime, stream: object) -> None:
        action = self.next_action()
        if action == "capture":
            self._capture(context, cudart, stream)
            action = "launch" if self._exec is not None else "execute"
        if action == "launch":
            check_cuda(cudart.cudaGraphLaunch(self._exec, stream), "cudaGraphLaunch")
            self.launches += 1
            return
        execute(context, stream)
        self.warmed = True

    def _capture(self, context: ExecutionContext, cudart: CudaRuntime, stream: object) -> None:
        capturable = getattr(context, "is_stream_capturable", None)
        if capturable is not None and not capturable(stream):
            self._give_up("TensorRT says the context is not stream capturable")
            return
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check_cuda(cudart.cudaStreamBeginCapture(stream, mode), "cudaStreamBeginCapture")
        try:
            enqueued = bool(context.execute_async_v3(stream))
        finally:
            error, graph = cudart.cudaStreamEndCapture(stream)
        if not enqueued or int(error) != 0:
            if int(error) == 0 and graph is not None:
                cudart.cudaGraphDestroy(graph)
            self._give_up(f"capture failed (enqueued: {enqueued}, cudaStreamEndCapture: {error})")
            return
        self._graph = graph
        self._exec = check_cuda(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        self.captures += 1

    def _give_up(self, reason: str) -> None:
        logger.info("the decode step runs without a CUDA graph: %s", reason)
        self.failed = True

    def reset(self, cudart: CudaRuntime) -> None:
        """Drop the graph (the context was bound to other addresses since): captured again after a warm-up."""
        if self._exec is not None:
            cudart.cudaGraphExecDestroy(self._exec)
        if self._graph is not None:
            cudart.cudaGraphDestroy(self._graph)
        self._graph = self._exec = None
        self.warmed = False


def execute(context: ExecutionContext, stream: object) -> None:
    if not context.execute_async_v3(stream):
        raise InferenceError("TensorRT failed to enqueue a generation step")
