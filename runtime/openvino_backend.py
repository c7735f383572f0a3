"""OpenVINO backend: an artifact's ONNX file read by OpenVINO's ONNX frontend and compiled for its CPU plugin.

OpenVINO is optional (`pip install 'tensorsmith[openvino]'`) and imported only when a backend is made.
"""

from __future__ import annotations

import logging
import queue
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.runtime.artifact import Artifact
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.errors import BackendUnavailable, InferenceError, RuntimeLoadError
from tensorsmith.runtime.openvino_ops import UNSUPPORTED, conversion_extensions
from tensorsmith.runtime.specs import Limits, TensorSpec

if TYPE_CHECKING:
    import openvino

logger = logging.getLogger(__name__)

DEVICE = "CPU"
INSTALL_HINT = "pip install 'tensorsmith[openvino]'"
# OpenVINO 2026.4's CPU plugin fuses MatMul → Softmax → MatMul without an additive mask into one "snippets"
# subgraph that, on dynamic shapes, computes wrong values (relative errors of 10-100, any head size) for every
# sequence length after a run of length 1; with a mask (MiniLM) it is right. Off, nothing measurable was lost on
# MiniLM (AVX2, 2 threads); `config={"SNIPPETS_MODE": "DISABLE"}` turns the fusion back on.
SAFE_CONFIG: dict[str, object] = {"SNIPPETS_MODE": "DISABLE"}


def openvino_unavailable() -> str | None:
    """Why OpenVINO cannot be used here, or None when it can."""
    try:
        import openvino  # noqa: F401
    except ImportError as err:
        return f"openvino is not installed ({err}); {INSTALL_HINT}"
    return None


def open_backend(artifact: Artifact) -> OpenVinoBackend:
    """The cpu variant (runtime/backends.py), where OpenVINO is installed and has the graph's ops (a static KV
    cache's TensorScatter through runtime/openvino_ops.py)."""
    reason = openvino_unavailable()
    if reason is not None:
        raise BackendUnavailable(reason, hint="use backend='auto'")
    path, _ = artifact.cpu_variant()
    return OpenVinoBackend(
        path, artifact.inputs, artifact.outputs, limits=artifact.manifest.dims, static_cache=artifact.static_cache
    )


class OpenVinoBackend(Backend):
    def __init__(
        self,
        model_path: Path,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        limits: Limits | None = None,
        threads: int | None = None,
        performance_hint: str = "LATENCY",
        inference_precision: str = "f32",
        config: Mapping[str, object] | None = None,
        static_cache: bool = False,
    ) -> None:
        """`threads`: OpenVINO's INFERENCE_NUM_THREADS (None: its default, every core); `performance_hint`:
        LATENCY (one stream, for one caller) or THROUGHPUT; `inference_precision`: f32 by default, because on a
        CPU with AMX OpenVINO would otherwise compute the float layers in bf16, not what the artifact's
        accuracy was measured in; `config`: further CPU plugin properties, over SAFE_CONFIG; `static_cache`: the
        graph is a static-cache decoder's, whose Attention nodes runtime/openvino_ops.py translates."""
        super().__init__(inputs, outputs, limits)
        try:
            import openvino
        except ImportError as err:
            raise RuntimeLoadError("openvino is not installed", hint=INSTALL_HINT) from err
        properties: dict[str, object] = {
            "PERFORMANCE_HINT": performance_hint,
            "INFERENCE_PRECISION_HINT": inference_precision,
            **SAFE_CONFIG,
        }
        if threads is not None:
            properties["INFERENCE_NUM_THREADS"] = threads
        properties.update(config or {})
        core = openvino.Core()
        for extension in conversion_extensions(grouped_attention=static_cache):
            core.add_extension(extension)
        try:
            # The ONNX frontend keeps the file's dynamic dims, so one compiled model serves every batch and
            # sequence length (and a KV cache's zero-length past).
            self._compiled: openvino.CompiledModel | None = core.compile_model(
                core.read_model(str(model_path)), DEVICE, properties
            )
        except RuntimeError as err:  # OpenVINO raises RuntimeError for a file it cannot read, convert or compile
            raise RuntimeLoadError(
                f"OpenVINO could not load {model_path}: {openvino_reason(err)}",
                hint="check the file with `tensorsmith inspect`; use backend='onnxruntime' for ops OpenVINO lacks",
            ) from err
        self.name = f"openvino:{DEVICE}"
        spec_names = {spec.name for spec in self.outputs}
        self._output_names = [_onnx_name(output.get_names(), spec_names) for output in self._compiled.outputs]
        # Idle infer requests: a call takes one (or makes one when every request is busy) and gives it back, so
        # one caller reuses one request and its buffers, and concurrent callers never share one (an infer
        # request is not thread-safe; a lock would serialize them instead).
        self._idle: queue.SimpleQueue[openvino.InferRequest] = queue.SimpleQueue()
        logger.debug("loaded %s on OpenVINO %s with %s", model_path, DEVICE, properties)

    def _run_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._compiled is None:
            raise InferenceError(f"{self.name} was closed")
        try:
            request = self._idle.get_nowait()
        except queue.Empty:
            request = self._compiled.create_infer_request()
        try:
            # share_outputs=False: the arrays are copies, not views of the request's buffers that its next run
            # overwrites (generate feeds a step's present back as the next step's past).
            values = request.infer(feeds, share_inputs=False, share_outputs=False).to_tuple()
        except RuntimeError as err:  # a kernel failing on these values; the request is dropped with it
            raise InferenceError(f"OpenVINO failed running {self.name}: {openvino_reason(err)}") from err
        self._idle.put(request)
        return dict(zip(self._output_names, values, strict=True))

    def close(self) -> None:
        """Release the compiled model and its infer requests."""
        self._compiled = None
        self._idle = queue.SimpleQueue()


def _onnx_name(names: set[str], spec_names: set[str]) -> str:
    """The output's ONNX name: OpenVINO may give a tensor more than one (a graph output that is also an inner
    value), so the one the specs use, else the first in sorted order."""
    matching = sorted(names & spec_names) or sorted(names)
    return matching[0]


# OpenVINO's location lines (`Exception from src/...cpp:84:`, `Check '...' failed at src/...cpp:117:`)
_LOCATION = re.compile(r"^(Exception from \S+:\d+:|Check '.*' failed at \S+:\d+:)$")
# a translator of runtime/openvino_ops.py refusing a node, inside the frontend's report (its Python stack follows)
_REFUSED = re.compile(rf"ONNX node '<Node\(\w+\): ([^>]*)>': ValueError: (.*?{UNSUPPORTED}.*?\))")


def openvino_reason(err: BaseException) -> str:
    """OpenVINO's error as one line, without the source locations it stacks in front (the rest names the file,
    the node or the op); a node runtime/openvino_ops.py refused, as its own line and the node's name."""
    refused = _REFUSED.search(str(err))
    if refused is not None:
        return f"{refused.group(2)}, node '{refused.group(1)}'"
    lines = [line.strip() for line in str(err).splitlines()]
    kept = [line for line in lines if line and not _LOCATION.match(line)]
    return " ".join(kept) if kept else type(err).__name__
