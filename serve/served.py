"""What the server serves: the settings it was started with, and the artifact once loaded (its model, its
generation engine or embedder, its tokenizer, its metrics)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.runtime.backends import AUTO
from tensorsmith.runtime.engine import GenerationEngine
from tensorsmith.runtime.errors import TensorsmithError
from tensorsmith.runtime.loader import Model, load
from tensorsmith.serve.embeddings import Embedder
from tensorsmith.serve.errors import OpenAIError
from tensorsmith.serve.metrics import ServeMetrics
from tensorsmith.serve.text import TextCodec


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    artifact: Path
    name: str  # the model's id in the API (`--served-model-name`; the artifact's folder name by default)
    slots: int = 8
    max_queue: int = 256
    max_sequence_length: int | None = None
    prefill_chunk: int = 256
    prefix_caching: bool = True
    chat_template: str | None = None
    tokenizer: Path | None = None  # where the artifact has none (a PyTorch source's encoder)
    metrics_prefix: str = "vllm:"
    backend: str = AUTO  # a row of runtime/backends.py, or auto

    def tokenizer_folder(self) -> Path:
        """Where tokenizer.json is: `tokenizer`, else the artifact's copy; a TensorsmithError without one."""
        folder = self.tokenizer or self.artifact / "tokenizer"
        if not (folder / "tokenizer.json").is_file():
            raise TensorsmithError(
                f"{self.artifact} has no tokenizer (tokenizer/tokenizer.json)"
                if self.tokenizer is None
                else f"{folder} has no tokenizer.json",
                hint="pass --tokenizer DIR, a folder with the model's tokenizer.json",
            )
        return folder


class Served:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.created = int(time.time())
        self.model: Model | None = None
        self.engine: GenerationEngine | None = None
        self.embedder: Embedder | None = None
        self.codec: TextCodec | None = None
        self.metrics: ServeMetrics | None = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        return self.metrics is not None

    def load(self) -> None:
        """Load the artifact and open what serves it (in a worker thread: the loop keeps answering /health)."""
        settings = self.settings
        self.codec = TextCodec(settings.tokenizer_folder(), settings.chat_template)
        model = self.model = load(settings.artifact, backend=settings.backend)
        if model.manifest.generation is not None:
            self.engine = model.engine(
                settings.slots,
                settings.max_sequence_length,
                settings.max_queue,
                settings.prefill_chunk,
                settings.prefix_caching,
            )
        else:
            self.embedder = Embedder(model, self.codec)
        prefix_caching = self.engine is not None and self.engine.prefix_caching
        self.metrics = ServeMetrics(self.name, model.backend, settings.metrics_prefix, prefix_caching)

    def check(self, model: str | None) -> None:
        """503 until loaded; 404 for another model's name."""
        if not self.ready:
            raise OpenAIError(503, "the model is still loading", hint="wait until /health answers 200")
        if model is not None and model != self.name:
            raise OpenAIError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.name}`",
                param="model",
                code="model_not_found",
            )

    def generation(self, model: str | None) -> tuple[GenerationEngine, TextCodec]:
        self.check(model)
        if self.engine is None or self.codec is None:
            raise OpenAIError(
                400, f"`{self.name}` is an encoder: it serves /v1/embeddings, not completions", param="model"
            )
        return self.engine, self.codec

    def embeddings(self, model: str | None) -> Embedder:
        self.check(model)
        if self.embedder is None:
            raise OpenAIError(
                400,
                f"`{self.name}` generates text: it serves /v1/completions and /v1/chat/completions, not embeddings",
                param="model",
            )
        return self.embedder

    def close(self) -> None:
        """Finish the requests the engine runs, then release the model."""
        if self.engine is not None:
            self.engine.close(drain=True)
        if self.model is not None:
            self.model.close()
