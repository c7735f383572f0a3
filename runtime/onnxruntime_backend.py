"""ONNX Runtime backend: the CUDA execution provider when this onnxruntime build has it, else the CPU one."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tensorsmith.runtime.artifact import Artifact
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.errors import InferenceError, InputError, RuntimeLoadError, onnxruntime_reason
from tensorsmith.runtime.kv_cache import CacheSession, CacheShape
from tensorsmith.runtime.onnxruntime_cache import OnnxRuntimeStaticCache
from tensorsmith.runtime.onnxruntime_slots import OnnxRuntimeSlotCache
from tensorsmith.runtime.slots import SlotCache
from tensorsmith.runtime.specs import Limits, TensorSpec

logger = logging.getLogger(__name__)

WARNING_SEVERITY, ERROR_SEVERITY = 2, 3  # ONNX Runtime's log severities
PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")


def available_providers() -> list[str]:
    import onnxruntime

    available = set(onnxruntime.get_available_providers())
    return [provider for provider in PREFERRED_PROVIDERS if provider in available]


class OnnxRuntimeBackend(Backend):
    def __init__(
        self,
        model_path: Path,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        providers: Sequence[str] | None = None,
        limits: Limits | None = None,
        disabled_optimizers: Sequence[str] = (),
        session_config: Mapping[str, str] | None = None,
    ) -> None:
        """`disabled_optimizers`: ONNX Runtime graph optimizers to switch off, `session_config`: session config
        entries (the manifest's measured choices)."""
        super().__init__(inputs, outputs, limits)
        try:
            import onnxruntime
        except ImportError as err:
            raise RuntimeLoadError(
                "onnxruntime is not installed", hint="pip install 'tensorsmith[cpu]' (or [gpu] for CUDA)"
            ) from err
        chosen = list(providers) if providers else available_providers()
        options = onnxruntime.SessionOptions()
        # ONNX Runtime's optimizer notes (e.g. a node it could not eliminate) are for debugging, not a service log.
        options.log_severity_level = WARNING_SEVERITY if logger.isEnabledFor(logging.DEBUG) else ERROR_SEVERITY
        for key, value in (session_config or {}).items():
            options.add_session_config_entry(key, value)
        try:
            self._session = onnxruntime.InferenceSession(
                str(model_path), options, providers=chosen, disabled_optimizers=list(disabled_optimizers)
            )
        except Exception as err:  # onnxruntime raises its own untyped exceptions (Fail, InvalidGraph, ...)
            raise RuntimeLoadError(
                f"ONNX Runtime could not load {model_path}: {onnxruntime_reason(err)}",
                hint="check the file with `tensorsmith inspect`; recompile the artifact if it is damaged",
            ) from err
        # ONNX Runtime quietly drops a provider that fails to initialise; report the one actually in use.
        self.provider = self._session.get_providers()[0]
        self.name = f"onnxruntime:{self.provider}"
        self._output_names = [output.name for output in self._session.get_outputs()]
        self.disabled_optimizers = list(disabled_optimizers)
        disabled = ", ".join(self.disabled_optimizers) or "none"
        logger.debug("loaded %s with providers %s, optimizers disabled: %s", model_path, chosen, disabled)

    def open_cache(self, shape: CacheShape, static: bool) -> CacheSession:
        """The static cache bound in place (runtime/onnxruntime_cache.py); the dynamic one as every backend's."""
        if not static:
            return super().open_cache(shape, static)

        logits = next(spec for spec in self.outputs if spec.name == "logits")
        device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        fixed = self._fixed_capacity(shape)
        if fixed is not None:  # a graph written for an engine: the cache as long as the longest request
            shape = dataclasses.replace(shape, capacity=fixed)
        return OnnxRuntimeStaticCache(self._session, shape, int(logits.shape[-1]), np.dtype(logits.dtype), device)

    def open_slots(self, shape: CacheShape) -> SlotCache:
        """On the CPU provider the slots are bound in place (runtime/onnxruntime_slots.py); on CUDA through the
        host, as every backend's."""
        fixed = self._fixed_capacity(shape)
        if fixed is not None and fixed != shape.capacity:
            raise InputError(
                f"this graph's cache holds {fixed} tokens, not {shape.capacity}",
                hint=f"open the engine with max_sequence_length={fixed}",
            )
        if self.provider != "CPUExecutionProvider":
            return super().open_slots(shape)

        return OnnxRuntimeSlotCache(self._session, shape)

    def _fixed_capacity(self, shape: CacheShape) -> int | None:
        """The cache length the graph fixes (one written for an engine), None where it is a dynamic dim."""
        fixed = next(i.shape[2] for i in self._session.get_inputs() if i.name == shape.growing_pasts[0])
        return fixed if isinstance(fixed, int) else None

    def _run_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # InferenceSession.run is thread-safe, so one session serves concurrent callers.
        try:
            values = self._session.run(self._output_names, feeds)
        except Exception as err:  # onnxruntime's own untyped errors (a kernel failing on these values)
            raise InferenceError(f"ONNX Runtime failed running {self.name}: {onnxruntime_reason(err)}") from err
        return dict(zip(self._output_names, values, strict=True))


def open_backend(artifact: Artifact) -> OnnxRuntimeBackend:
    """The cpu variant (runtime/backends.py), with the session settings the compile measured for the CPU provider;
    on a GPU, CUDA's provider first."""
    path, variant = artifact.cpu_variant()
    cpu = artifact.device.compute_capability is None
    providers = ["CPUExecutionProvider"] if cpu else None  # None: CUDA where this onnxruntime has it
    measured = variant if cpu else None  # the settings were timed on the CPU provider
    return OnnxRuntimeBackend(
        path,
        artifact.inputs,
        artifact.outputs,
        providers,
        limits=artifact.manifest.dims,
        disabled_optimizers=measured.onnxruntime_disabled_optimizers if measured else [],
        session_config=measured.onnxruntime_session_config if measured else {},
    )
