"""`load()`: open an artifact directory on the best backend this machine has, and say why if it fell back."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.device import Device, detect_device
from tensorsmith.runtime.errors import ArtifactError, InputError, RuntimeLoadError
from tensorsmith.runtime.kv_cache import CacheSession
from tensorsmith.runtime.manifest import EngineRecord, Manifest, VariantRecord, read_manifest, verified_file
from tensorsmith.runtime.selection import select_engine
from tensorsmith.runtime.specs import TensorSpec

if TYPE_CHECKING:
    from tensorsmith.runtime.engine import GenerationEngine

logger = logging.getLogger(__name__)

BackendChoice = Literal["auto", "tensorrt", "onnxruntime", "openvino"]
CPU_TARGET = "cpu"


class Model:
    """A loaded artifact. `run(feeds) -> outputs`; `backend` and `fallback_reason` tell what was chosen and why."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        backend: Backend,
        fallback_reason: str | None,
        engine: EngineRecord | None = None,
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self._backend = backend
        self._engine = engine
        self.fallback_reason = fallback_reason

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._backend.inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._backend.outputs

    @property
    def max_batch(self) -> int | None:
        """The largest batch (first dim of every input and output) to send: the engine profile's on TensorRT,
        the compile's declared [dims] max on ONNX Runtime; None when the model has no batch dim or no limit."""
        return self.manifest.batch_limits(self._engine)[0]

    def run(self, feeds: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Run once. Raises ValueError naming any input whose name, dtype, rank or static dims are wrong;
        `token_type_ids`, where the model takes them, default to zeros (as in transformers)."""
        return self._backend.run(feeds)

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_beams: int = 1,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        streamer: Any = None,
    ) -> np.ndarray:
        """A decoder artifact's sequences, prompt included, as transformers' `generate` returns them: prefill,
        then one token per step with the KV cache kept here. A batch of prompts is left padded (`attention_mask`
        zeros first). `eos_token_id` defaults to the checkpoint's; rows that finish are padded."""
        from tensorsmith.runtime.generation import Generator, Sampling
        from tensorsmith.runtime.generation_request import check_request

        # every setting and token id checked before anything runs (InputError, a ValueError, naming it)
        request = check_request(
            self.manifest,
            str(self.directory),
            input_ids,
            attention_mask,
            max_new_tokens,
            Sampling(do_sample, temperature, top_k, top_p),
            num_beams,
            eos_token_id,
            pad_token_id,
            seed,
        )
        if streamer is not None and request.num_beams > 1:  # transformers raises too: beams are reordered
            raise InputError(
                "a streamer cannot follow beam search (the beams change until the end)",
                hint="stream with num_beams 1, or read the sequences generate() returns",
            )
        from tensorsmith.runtime.kv_cache import CacheShape

        dtype = self._cache_dtype()
        static = request.layout.kv_cache == "static"

        def open_cache(rows: int, capacity: int) -> CacheSession:
            return self._backend.open_cache(CacheShape(request.layout, rows, capacity, dtype), static)

        generator = Generator(open_cache)
        return generator.generate(
            request.prompt,
            request.mask,
            request.max_new_tokens,
            request.sampling,
            request.num_beams,
            request.eos,
            request.pad,
            request.seed,
            streamer,
        )

    def engine(
        self, slots: int = 8, max_sequence_length: int | None = None, max_queue: int = 256, prefill_chunk: int = 256
    ) -> GenerationEngine:
        """A continuous-batching engine over this decoder (runtime/engine.py): `slots` requests decode together,
        each of at most `max_sequence_length` tokens (the compile's by default), with `max_queue` more waiting.
        Up to `prefill_chunk` prompt tokens are read a turn. Close it (or use it as a context manager) when done."""
        from tensorsmith.runtime.engine import GenerationEngine
        from tensorsmith.runtime.kv_cache import CacheShape

        layout = self.manifest.generation
        if layout is None or layout.kv_cache != "static":
            what = "not a decoder artifact" if layout is None else "compiled with the dynamic KV cache"
            raise InputError(
                f"{self.directory} is {what}: continuous batching needs the static cache",
                hint="compile the decoder with --kv-cache static (the default)",
            )
        capacity = max_sequence_length or layout.max_sequence_length
        for name, value, low, high in (
            ("slots", slots, 1, self.max_batch),
            ("max_queue", max_queue, 0, None),
            ("prefill_chunk", prefill_chunk, 1, None),
            ("max_sequence_length", capacity, 2, layout.max_sequence_length),
        ):
            if not isinstance(value, int) or value < low or (high is not None and value > high):
                bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
                raise InputError(
                    f"{name} is {value!r}, and must be an integer {bound}",
                    hint="the artifact's limits come from its compile ([generation] max_batch and max_sequence_length)",
                )
        shape = CacheShape(layout, slots, capacity, self._cache_dtype())
        return GenerationEngine(
            self._backend.open_slots(shape), self.manifest, str(self.directory), max_queue, prefill_chunk
        )

    def _cache_dtype(self) -> np.dtype:
        """The dtype the backend's graph takes for the cache (fp16 in a GPU engine where the manifest says fp32)."""
        from tensorsmith.runtime.kv_cache import past_name

        assert self.manifest.generation is not None
        layout = self.manifest.generation
        first = layout.attention_layers[0] if layout.attention_layers else 0
        return self._backend.input_dtype(past_name(first, layout.layer_tensors(first)[0]))

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Model({str(self.directory)!r}, backend={self.backend!r})"


def _cpu_variant(directory: Path, manifest: Manifest) -> tuple[Path, VariantRecord | None]:
    """The variant the manifest assigns to the `cpu` target (its record: the backend and ONNX Runtime settings
    the compile measured), else the fp32 reference graph (a large decoder's GPU-only artifact leaves it out)."""
    for target in manifest.targets:
        if target.name == CPU_TARGET:
            variant = manifest.variant(target.variant)
            return verified_file(directory, variant.path, variant.sha256), variant
    if manifest.model is None:
        raise ArtifactError(
            f"{directory} has neither a cpu target nor the fp32 reference graph to run without its "
            "targets' GPUs (a large decoder's reference is left out)",
            hint="compile it again with --target cpu",
        )
    return verified_file(directory, manifest.model.path, manifest.model.sha256), None


def _cpu_backend(
    directory: Path,
    manifest: Manifest,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    device: Device,
    choice: BackendChoice,
) -> tuple[Backend, str | None]:
    """The cpu variant on the backend its record names (OpenVINO where the compile measured it faster and it is
    installed) or `choice` asks for, else ONNX Runtime (CUDA first on a GPU); with why it is not the recorded
    one, if it is not."""
    from tensorsmith.runtime.onnxruntime_backend import OnnxRuntimeBackend

    path, variant = _cpu_variant(directory, manifest)
    providers = _onnxruntime_providers(device)
    cpu = providers == ["CPUExecutionProvider"]
    reason = None
    recorded = variant is not None and variant.backend == "openvino" and cpu and choice != "onnxruntime"
    if recorded or choice == "openvino":
        from tensorsmith.runtime.openvino_backend import OpenVinoBackend, openvino_unavailable

        static = manifest.generation is not None and manifest.generation.kv_cache == "static"
        reason = "OpenVINO has no TensorScatter for the static KV cache" if static else openvino_unavailable()
        if reason is None:
            return OpenVinoBackend(path, inputs, outputs, limits=manifest.dims), None
        if choice == "openvino":
            hint = "compile with --kv-cache dynamic, or use backend='auto'" if static else "use backend='auto'"
            raise RuntimeLoadError(f"cannot load {directory} on OpenVINO: {reason}", hint=hint)
        assert variant is not None
        reason = f"the compile chose OpenVINO for {variant.name}, but {reason}: ONNX Runtime instead"
        logger.info("%s", reason)
    disabled = variant.onnxruntime_disabled_optimizers if variant is not None and cpu else []
    config = variant.onnxruntime_session_config if variant is not None and cpu else {}
    chosen = OnnxRuntimeBackend(
        path, inputs, outputs, providers, limits=manifest.dims, disabled_optimizers=disabled, session_config=config
    )
    return chosen, reason


def _onnxruntime_providers(device: Device) -> list[str] | None:
    """CUDA first when there is a device and this onnxruntime has the provider; None: the backend's default."""
    return None if device.compute_capability else ["CPUExecutionProvider"]


def load(path: str | Path, backend: BackendChoice = "auto", device: Device | None = None) -> Model:
    """Load the artifact at `path`: the TensorRT engine for this GPU when there is one, else ONNX Runtime
    (CUDA, then CPU). `backend="tensorrt"` raises instead of falling back; `device` overrides detection.
    `model.backend` says what runs it and `model.fallback_reason` why it is not TensorRT."""
    directory = Path(path)
    manifest = read_manifest(directory)
    inputs = [record.spec() for record in manifest.inputs]
    outputs = [record.spec() for record in manifest.outputs]
    device = device or detect_device()

    fallback_reason: str | None = None
    if backend in ("auto", "tensorrt"):
        selection = select_engine(manifest, device, directory)
        if selection.target is not None and selection.path is not None:
            from tensorsmith.runtime.tensorrt_backend import TensorRTBackend

            try:
                engine = TensorRTBackend(
                    selection.path, selection.target.builder, selection.target.name, inputs, outputs
                )
                return Model(directory, manifest, engine, None, selection.target.engine)
            except RuntimeLoadError as err:
                if backend == "tensorrt":
                    raise
                fallback_reason = str(err)
        else:
            fallback_reason = selection.reason
        if backend == "tensorrt":
            raise RuntimeLoadError(f"cannot load {directory} on TensorRT: {fallback_reason}", hint="use backend='auto'")
        logger.info("falling back to ONNX Runtime: %s", fallback_reason)

    chosen, cpu_reason = _cpu_backend(directory, manifest, inputs, outputs, device, backend)
    reasons = [reason for reason in (fallback_reason, cpu_reason) if reason]
    return Model(directory, manifest, chosen, "; ".join(reasons) or None)
