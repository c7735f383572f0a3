"""Data-centre TensorRT's timing cache, per (target, builder, version); TensorRT for RTX makes it a no-op."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from tensorsmith.compiler.targets import Builder

if TYPE_CHECKING:
    import tensorrt as trt_api

logger = logging.getLogger(__name__)


class TimingCache:
    """A timing cache per (target, builder, version) under `directory`, loaded before a build and saved after;
    TensorRT for RTX makes timing caches no-ops, so it is used with data-centre TensorRT only."""

    def __init__(
        self, trt: ModuleType, config: trt_api.IBuilderConfig, builder: Builder, target: str, directory: Path | None
    ) -> None:
        self.config = config
        self.path = None
        self.reason = ""
        if builder == "tensorrt-rtx":
            self.reason = "not used: TensorRT for RTX makes timing caches no-ops"
        elif directory is None:
            self.reason = "not used: no timing_cache_dir"
        else:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"{target}-{builder}-{trt.__version__}.cache"
            data = self.path.read_bytes() if self.path.is_file() else b""
            self.cache = config.create_timing_cache(data)
            config.set_timing_cache(self.cache, ignore_mismatch=False)
            self.before = len(self.cache.queryKeys())

    def save(self) -> dict[str, int | str]:
        if self.path is None:
            return {"status": self.reason}
        cache = self.config.get_timing_cache()
        data = bytes(cache.serialize())
        self.path.write_bytes(data)
        after = len(cache.queryKeys())
        logger.info("timing cache %s: %d entries reused, %d new", self.path.name, self.before, after - self.before)
        return {"path": str(self.path), "entries_reused": self.before, "entries_added": after - self.before}
