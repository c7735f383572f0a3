"""`load()`: open an artifact directory on the best backend this machine has, and say why if it fell back."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.runtime.artifact import Artifact
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.backends import AUTO, BackendSpec, backend_named, cpu_backends, engine_backends
from tensorsmith.runtime.device import Device, detect_device
from tensorsmith.runtime.engine import GenerationEngine
from tensorsmith.runtime.errors import ArtifactError, BackendUnavailable, InputError, RuntimeLoadError
from tensorsmith.runtime.generation import Generator, Streamer
from tensorsmith.runtime.generation_request import check_request
from tensorsmith.runtime.kv_cache import CacheSession, CacheShape, past_name
from tensorsmith.runtime.manifest import Manifest, read_manifest
from tensorsmith.runtime.sampling import Sampling
from tensorsmith.runtime.specs import TensorSpec

if TYPE_CHECKING:
    from tensorsmith.runtime.engine import GenerationEngine

logger = logging.getLogger(__name__)


class Model:
    """A loaded artifact. `run(feeds) -> outputs`; `backend` and `fallback_reason` tell what was chosen and why."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        backend: Backend,
        fallback_reason: str | None,
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self._backend = backend
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
        return self.manifest.batch_limits(self._backend.engine)[0]

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
        streamer: Streamer | None = None,
    ) -> np.ndarray:
        """A decoder artifact's sequences, prompt included, as transformers' `generate` returns them: prefill,
        then one token per step with the KV cache kept here. A batch of prompts is left padded (`attention_mask`
        zeros first). `eos_token_id` defaults to the checkpoint's; rows that finish are padded."""
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

        dtype = self._cache_dtype()
        static = request.layout.kv_cache == "static"

        def open_cache(rows: int, capacity: int) -> CacheSession:
            return self._backend.open_cache(CacheShape(request.layout, rows, capacity, dtype), static)

        return Generator(open_cache).generate(request, streamer)

    def engine(
        self,
        slots: int = 8,
        max_sequence_length: int | None = None,
        max_queue: int = 256,
        prefill_chunk: int = 256,
        prefix_caching: bool = True,
    ) -> GenerationEngine:
        """A continuous-batching engine over this decoder (runtime/engine.py): `slots` requests decode together,
        each of at most `max_sequence_length` tokens (the compile's by default), with `max_queue` more waiting.
        Up to `prefill_chunk` prompt tokens are read a turn; with `prefix_caching`, a prompt that starts as an
        earlier request's did reuses that slot's cache for it (runtime/prefix_cache.py). Close it (or use it as a
        context manager) when done."""
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
            self._backend.open_slots(shape),
            self.manifest,
            str(self.directory),
            max_queue,
            prefill_chunk,
            prefix_caching,
        )

    def _cache_dtype(self) -> np.dtype:
        """The dtype the backend's graph takes for the cache (fp16 in a GPU engine where the manifest says fp32)."""
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


def _candidates(artifact: Artifact, asked: str) -> list[BackendSpec]:
    """The rows `load(backend=asked)` tries, in order: the one asked for; else (auto) the engine rows, then the cpu
    variant on the backend the compile recorded for it (on a machine without a GPU, which ONNX Runtime's CUDA
    provider would use) and on the default cpu row."""
    if asked != AUTO:
        return [backend_named(asked)]
    recorded = artifact.recorded_cpu_backend() if artifact.device.compute_capability is None else None
    cpu = [*([backend_named(recorded)] if recorded else []), cpu_backends()[0]]
    return list(dict.fromkeys([*engine_backends(), *cpu]))


def _open(spec: BackendSpec, artifact: Artifact) -> Backend:
    opened: Backend = importlib.import_module(spec.module).open_backend(artifact)
    return opened


def _why_not(spec: BackendSpec, artifact: Artifact, reason: str) -> str:
    """A skipped row's reason as the fallback says it: a cpu backend the compile chose says so."""
    record = artifact.cpu_record()  # not the verified file: its sha256 is read where a backend opens it
    if spec.runs_engines or record is None or record.backend != spec.name:
        return reason
    return f"the compile chose {spec.title} for {record.name}, but {reason}"


def load(path: str | Path, backend: str = AUTO, device: Device | None = None) -> Model:
    """Load the artifact at `path`: the TensorRT engine for this GPU when there is one, else the cpu variant on the
    backend the compile measured fastest, else ONNX Runtime (CUDA, then CPU); `backend` names one row of
    runtime/backends.py instead, and raises rather than fall back. `device` overrides detection. `model.backend`
    says what runs it and `model.fallback_reason` why it is not the first choice."""
    directory = Path(path)
    manifest = read_manifest(directory)
    inputs = [record.spec() for record in manifest.inputs]
    outputs = [record.spec() for record in manifest.outputs]
    artifact = Artifact(directory, manifest, inputs, outputs, device or detect_device())
    try:
        tried = _candidates(artifact, backend)
    except ValueError as err:
        raise InputError(str(err), hint="backend='auto' picks one") from None
    reasons: list[str] = []
    for spec in tried:
        try:
            opened = _open(spec, artifact)
        except ArtifactError:
            raise
        except RuntimeLoadError as err:
            if backend != AUTO:
                raise RuntimeLoadError(f"cannot load {directory} on {spec.title}: {err.message}", err.hint) from err
            if spec is tried[-1]:
                raise
            reasons.append(_why_not(spec, artifact, err.message if isinstance(err, BackendUnavailable) else str(err)))
            continue
        if reasons:
            logger.info("%s runs on %s: %s", directory, spec.title, "; ".join(reasons))
        return Model(directory, manifest, opened, "; ".join(reasons) or None)
    raise AssertionError("the last candidate returns or raises")
