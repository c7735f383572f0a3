"""What the manifest says of the source (`source_record`), and the sha256 of its files: that record's, and the
export cache's key.

A Hugging Face directory is the largest input a compile reads (2.5 GB at Llama-3.2-1B's shape, 29.5 GB at
Qwen2.5-14B's), and hashing it took 4.4 s of a 1B compile's 91 s. hashlib releases the GIL while it hashes, so the
digests are computed on a thread while the export traces the model on the other core (`SourceDigests`), and read
when the source's record is written.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.exported import ExportedModel
from tensorsmith.compiler.frontend.quantized_checkpoint import stored_weights
from tensorsmith.core.ir import ai_onnx_opset
from tensorsmith.runtime.manifest import SourceRecord, sha256_of


def source_files(
    config: CompileConfig, stop: threading.Event | None = None, record_only: bool = False
) -> dict[str, str] | None:
    """The sha256 of each file of a Hugging Face directory (config, weights, index, tokenizer) or of a .pt2 file, by
    name: hashed once, for the key and the manifest's source record. `record_only`: the files the record's digest
    covers (config.json and the safetensors shards), for a compile without the export cache. None for a factory or
    an ONNX file, and where `stop` is set before the last file is hashed."""
    if config.source_kind not in ("huggingface", "exported_program"):
        return None
    path = config.resolve(config.source)
    if not path.is_dir():
        files = [path]
    elif record_only:
        files = [path / name for name in _recorded_names(path)]
    else:
        files = sorted(child for child in path.iterdir() if child.is_file())
    digests: dict[str, str] = {}
    for file in files:
        if stop is not None and stop.is_set():
            return None
        digests[file.name] = sha256_of(file)
    return digests


class SourceDigests:
    """`source_files(config, record_only=True)`, computed on a thread from construction; `result()` waits for it.
    `stop()` ends the thread after the file it is hashing (a compile that failed does not wait for the rest)."""

    def __init__(self, config: CompileConfig) -> None:
        self._stop = threading.Event()
        pool = ThreadPoolExecutor(1, thread_name_prefix="source-sha256")
        self._digests = pool.submit(source_files, config, self._stop, record_only=True)
        pool.shutdown(wait=False)

    def result(self) -> dict[str, str] | None:
        return self._digests.result()

    def stop(self) -> None:
        self._stop.set()


def source_record(
    config: CompileConfig, exported: ExportedModel, files: Mapping[str, str] | None = None
) -> SourceRecord:
    """What the manifest says of the source. `files`: the sha256 of its files by name, where already computed
    (source_digests.source_files)."""
    if config.source_kind == "factory":
        checkpoint = config.resolve(config.checkpoint) if config.checkpoint else None
        return SourceRecord(
            kind="factory",
            path=config.source,
            sha256=sha256_of(checkpoint) if checkpoint else None,
            checkpoint=str(checkpoint) if checkpoint else None,
            exporter=exported.exporter,
            fallback_reason=exported.fallback_reason,
            opset=ai_onnx_opset(exported.model),
            warnings=exported.warnings,
        )
    path = config.resolve(config.source)
    return SourceRecord(
        kind=config.source_kind,
        path=str(path),
        sha256=_directory_digest(path, files) if path.is_dir() else files[path.name] if files else sha256_of(path),
        weights=stored_weights(path) if config.source_kind == "huggingface" else None,
        exporter=exported.exporter,
        fallback_reason=exported.fallback_reason,
        traced_layers=exported.traced_layers,
        opset=ai_onnx_opset(exported.model),
        warnings=exported.warnings,
    )


def _recorded_names(path: Path) -> list[str]:
    """The files of a model directory its record's digest covers, in order."""
    return ["config.json", *sorted(f.name for f in path.glob("*.safetensors"))]


def _directory_digest(path: Path, files: Mapping[str, str] | None = None) -> str:
    """A model directory's: over its config and weights files' own sha256s, in name order (taken from `files`
    where given)."""
    names = _recorded_names(path)
    digests = files if files is not None else {name: sha256_of(path / name) for name in names}
    return hashlib.sha256("".join(f"{name}:{digests[name]}\n" for name in names).encode()).hexdigest()
