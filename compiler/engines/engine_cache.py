"""A content-addressed cache of built engines, so a second compile of the same graph skips the build.

TensorRT for RTX has no timing cache (its timing-cache operations are no-ops), so the cache that makes a
repeated CI compile fast is one level up: the serialized engine itself, keyed by everything the build depends
on: the variant's bytes (sha256), the target, the builder and its version, the optimization profile and the
builder options. A hit returns the engine that the same inputs produced before; nothing is ever served for
inputs that differ in any of those. Opt in with `[build] engine_cache_dir`, `--engine-cache DIR` or
TENSORSMITH_ENGINE_CACHE (CI: keep the directory with actions/cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tensorsmith.compiler.engines.profile import Profile
from tensorsmith.compiler.settings import BuildConfig

logger = logging.getLogger(__name__)

ENV_VARIABLE = "TENSORSMITH_ENGINE_CACHE"
COPY_CHUNK = 16 << 20


def cache_key(
    onnx_sha256: str, target: str, builder: str, version: str, profiles: Sequence[Profile], options: BuildConfig
) -> str:
    settings = options.cache_settings()
    # one unnamed profile keeps the key engines were cached under before profiles had names
    shapes = (
        profiles[0].as_record()
        if len(profiles) == 1 and not profiles[0].name
        else [{"name": p.name, "shapes": p.as_record()} for p in profiles]
    )
    described = json.dumps([onnx_sha256, target, builder, version, shapes, settings], sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()


class EngineCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory.expanduser()

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.engine"

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        stored = path.with_suffix(".sha256")
        # A damaged entry (a disk error, a hand edit) is a miss, never an engine served.
        if not stored.is_file() or stored.read_text().strip() != hashlib.sha256(data).hexdigest():
            logger.warning("engine cache entry %s is damaged: rebuilding", path)
            return None
        return data

    def put_file(self, key: str, plan_path: Path) -> None:
        """put() from a plan's file, copied and hashed in chunks (a 1B decoder's plan is 3 GB)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with (
            plan_path.open("rb") as source,
            tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", delete=False) as stream,
        ):
            while chunk := source.read(COPY_CHUNK):
                digest.update(chunk)
                stream.write(chunk)
        os.replace(stream.name, path.with_suffix(".engine"))
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", delete=False) as stream:
            stream.write(digest.hexdigest().encode())
        os.replace(stream.name, path.with_suffix(".sha256"))

    def put(self, key: str, plan: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        for suffix, data in ((".engine", plan), (".sha256", hashlib.sha256(plan).hexdigest().encode())):
            # Write then rename: concurrent builds of the same key each leave a whole file.
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", delete=False) as stream:
                stream.write(data)
            os.replace(stream.name, path.with_suffix(suffix))


def configured_cache(directory: Path | None) -> EngineCache | None:
    """The cache the settings ask for: the configured directory, else $TENSORSMITH_ENGINE_CACHE, else none."""
    if directory is None and os.environ.get(ENV_VARIABLE):
        directory = Path(os.environ[ENV_VARIABLE])
    return EngineCache(directory) if directory is not None else None
