"""A content-addressed cache of the fused graph: what `compile` makes of a source before any variant (torch's export,
canonicalize and the fusions, verification's run on ONNX Runtime), so that compiling one checkpoint again, for other
precisions or targets (a CI matrix, a budget tried twice), skips the export.

The export is most of a small compile (12.6 of tinylm's 15.9 s) and a tenth to a third of a large one (11.7 s of the
SmolLM-135M shape's), and it depends on none of what the variants and engines read. The key is everything it does
depend on: the source's bytes (every file of a Hugging Face directory; a .pt2 file), the config's fields the front
end reads (all but `BACK_END_FIELDS`), the graph passes it runs, tensorsmith's own code and the versions of the
packages that export, rewrite and run the graph. A hit copies the graph and its weights into the artifact and checks
them against the sha256 they were stored with; nothing is served for a key that differs in any of those.

A factory source (`pkg.module:function`) is code: its key has the module the factory returned, as its weights and
buffers (bytes) and the source files of the factory and of every nn.Module class in it. Code those classes call from
other files and plain Python attributes the factory sets are not in the key (with such a factory, leave the cache
off or clear it). An ONNX source has no export to skip: it never uses the cache. Entries are never evicted: the
directory is the user's to clear, like the engine cache's.

Opt in like the engine cache: `export_cache_dir` in tensorsmith.toml, `--export-cache DIR` or
$TENSORSMITH_EXPORT_CACHE (CI: keep the directory with actions/cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.verify import VerifiedRun
from tensorsmith.core.importing import import_factory
from tensorsmith.core.tensor_ranges import TensorRange
from tensorsmith.passes import GraphPass, PassReport
from tensorsmith.passes.stored_reports import StoredReport
from tensorsmith.runtime.manifest import FileRecord, SourceRecord, external_data_path, sha256_of

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENV_VARIABLE = "TENSORSMITH_EXPORT_CACHE"
# read by the variants and engines only: a compile that differs in these alone gets the same fused graph
BACK_END_FIELDS = frozenset(
    {
        "precision",
        "budget",
        "overrides",
        "sensitivity_samples",
        "smoothing",
        "smoothing_alpha",
        "calibrator",
        "percentile",
        "int4_algorithm",
        "int4_block_size",
        "calibration",
        "calibration_samples",
        "calibration_stats",
        "calibration_batch_size",
        "evaluation",
        "tensorrt_cache_version",
        "targets",
        "build",
        "export_cache_dir",
        "check_resources",
        "layerwise",
    }
)
# the packages whose code exports, rewrites or runs the graph: a new version is a new key
PACKAGES = ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnx-graphsurgeon", "onnxruntime", "numpy")
TENSORSMITH_PACKAGES = ("core", "compiler", "passes", "calibration", "runtime", "cli", "samples")
ENTRY_INFO = "fused.json"
FROM_EXPORT_CACHE = "the fused graph from the export cache"  # how a hit's export step and the summary end
ENTRY_ARRAYS = "verified.npz"
COPY_CHUNK = 16 << 20  # bytes read, hashed and written at a time when a hit is copied


class ExportCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory.expanduser()

    def entry(self, key: str) -> Path:
        return self.directory / key[:2] / key


def configured_cache(directory: Path | None) -> ExportCache | None:
    """The cache the config asks for: its directory, else $TENSORSMITH_EXPORT_CACHE, else none."""
    if directory is None and os.environ.get(ENV_VARIABLE):
        directory = Path(os.environ[ENV_VARIABLE])
    return ExportCache(directory) if directory is not None else None


def cache_key(
    config: CompileConfig,
    passes: list[GraphPass],
    module: torch.nn.Module | None = None,
    files: Mapping[str, str] | None = None,
) -> str | None:
    """The fused graph's key, or None for an ONNX source. A factory source's key needs its built `module`, a
    directory's or a .pt2's its `files` (source_digests.source_files)."""
    if config.source_kind == "factory":
        assert module is not None, "a factory's key is its module's"
        source: object = _module_digest(config.source, module)
    elif config.source_kind in ("huggingface", "exported_program"):
        assert files is not None, "a file source's key is its files'"
        source = dict(files)
    else:
        return None
    front_end = config.model_dump(mode="json", exclude=set(BACK_END_FIELDS) | {"source", "checkpoint"})
    described = {
        "source": source,
        "config": front_end,
        "passes": [[graph_pass.name, getattr(graph_pass, "reason", None)] for graph_pass in passes],
        "code": _code_digest(),
        "versions": _versions(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def _module_digest(factory: str, module: torch.nn.Module) -> str:
    """The factory's name, the source files of the factory and of the module's classes, and every parameter's and
    buffer's name, dtype, shape and bytes."""
    import inspect

    import torch

    digest = hashlib.sha256(factory.encode())
    files = {inspect.getsourcefile(import_factory(factory))}
    files |= {inspect.getsourcefile(type(child)) for child in module.modules()}
    for name in sorted(str(f) for f in files if f):
        digest.update(f"{name}:{sha256_of(Path(name))}\n".encode())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            digest.update(flat.view(torch.uint8).numpy().data)  # the bytes, not a copy
    return digest.hexdigest()


@cache
def _code_digest() -> str:
    """Of tensorsmith's own Python files: any change to the compiler is a new key (an editable install included)."""
    import importlib

    digest = hashlib.sha256()
    for package in TENSORSMITH_PACKAGES:
        root = Path(importlib.import_module(f"tensorsmith.{package}").__path__[0])
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{package}/{path.relative_to(root)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@cache
def _versions() -> dict[str, str | None]:
    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {name: installed(name) for name in PACKAGES}


def _files(model: Path) -> list[Path]:
    """The graph's files: the ONNX file and its external data, if it has any."""
    sidecar = external_data_path(model)
    return [model, sidecar] if sidecar.is_file() else [model]


def store(
    cache: ExportCache,
    key: str,
    model: Path,
    record: FileRecord,
    source: SourceRecord,
    reports: list[PassReport],
    accuracy: dict[str, float],
    tuned: bool,
    verified: VerifiedRun | None,
    ranges: list[TensorRange] | None,
) -> None:
    """Keep the fused graph under `key`: written whole into a temporary directory, then renamed into place, so a
    reader never sees half an entry. An entry already there (another compile's) is kept; a cache that cannot be
    written is a warning, never a failed compile."""
    entry = cache.entry(key)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=entry.parent, prefix=f".{key[:8]}-") as temporary:
            staging = Path(temporary) / "entry"
            staging.mkdir()
            for path in _files(model):
                shutil.copyfile(path, staging / path.name)
            info = {
                "model": model.name,
                "sha256": record.sha256,
                "source": source.model_dump(mode="json"),
                "reports": [StoredReport.of(report).model_dump(mode="json") for report in reports],
                "accuracy": accuracy,
                "tuned": tuned,
                "verified": verified is not None,
                "ranges": None if ranges is None else [[r.name, r.low, r.high] for r in ranges],
            }
            (staging / ENTRY_INFO).write_text(json.dumps(info))
            if verified is not None:
                feeds, outputs = verified.feeds, verified.outputs
                arrays = {f"feed/{name}": value for name, value in feeds.items()}
                arrays.update({f"output/{index}": value for index, value in enumerate(outputs)})
                with (staging / ENTRY_ARRAYS).open("wb") as stream:
                    np.savez(stream, allow_pickle=False, **arrays)
            try:
                os.rename(staging, entry)  # atomic
            except OSError:
                if not entry.is_dir():
                    raise
                logger.info("export cache: %s was stored by another compile meanwhile", entry)
                return
        logger.info("export cache: stored %s", entry)
    except OSError as err:
        logger.warning("export cache %s: not stored (%s)", cache.directory, err)


def _copy_hashed(files: list[Path], directory: Path) -> str:
    """Copy `files` into `directory`, returning the sha256 of their bytes in order (sha256_of's, for a graph and its
    external data): one read of the weights, not a copy and then a check."""
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as source, (directory / path.name).open("wb") as copy:
            while chunk := source.read(COPY_CHUNK):
                digest.update(chunk)
                copy.write(chunk)
    return digest.hexdigest()


class CachedFusedGraph:
    """An entry read back: the graph copied to the artifact, and what the compile recorded of it."""

    def __init__(self, info: dict[str, object], arrays: dict[str, np.ndarray]) -> None:
        self.sha256 = str(info["sha256"])
        self.source = SourceRecord.model_validate(info["source"])
        stored = info["reports"]
        assert isinstance(stored, list), "an entry's reports are a list (store writes them so)"
        self.reports = [StoredReport.model_validate(report).report() for report in stored]
        self.accuracy: dict[str, float] = dict(info["accuracy"])  # type: ignore[call-overload]
        self.tuned = bool(info["tuned"])
        ranges = info["ranges"]
        self.ranges = None if ranges is None else [TensorRange(n, lo, hi) for n, lo, hi in ranges]  # type: ignore
        self.verified: VerifiedRun | None = None
        if info["verified"]:
            feeds = {name.removeprefix("feed/"): value for name, value in arrays.items() if name.startswith("feed/")}
            count = sum(name.startswith("output/") for name in arrays)
            self.verified = VerifiedRun(feeds, [arrays[f"output/{index}"] for index in range(count)])


def restore(cache: ExportCache, key: str, model: Path, ranges: bool) -> CachedFusedGraph | None:
    """The entry under `key` with its graph copied to `model` (and its external data beside it), or None: no entry,
    one without the tensor ranges the compile needs, or one whose files no longer match their sha256 (a miss, never
    a graph served)."""
    entry = cache.entry(key)
    info_path = entry / ENTRY_INFO
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return None
    if ranges and info["ranges"] is None:
        return None  # stored by a compile that did not measure them: this one writes an entry that has them
    stored = entry / str(info["model"])
    # the artifact's names: the entry was stored under them
    if _copy_hashed(_files(stored), model.parent) != info["sha256"]:
        logger.warning("export cache entry %s is damaged: exporting again", entry)
        for path in _files(model):
            path.unlink()
        shutil.rmtree(entry, ignore_errors=True)  # so that this compile's export takes its place
        return None
    arrays: dict[str, np.ndarray] = {}
    if info["verified"]:
        with np.load(entry / ENTRY_ARRAYS, allow_pickle=False) as stored_arrays:
            arrays = {name: stored_arrays[name] for name in stored_arrays.files}
    logger.info("export cache: %s", entry)
    return CachedFusedGraph(info, arrays)
