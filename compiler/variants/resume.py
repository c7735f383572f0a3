"""What a long calibration has finished, kept beside the artifact until it is published: a compile killed in the
middle (the kernel, a CI timeout, Ctrl-C) and run again takes each finished layer's result from here instead of
computing it again, and so ends with the same artifact, bit for bit.

The records live in `.OUT.resume/<key>/` beside OUT, one `.npz` file per record, each written to a temporary name
and renamed (a record is whole or absent). The key hashes what the results depend on: the fused graph's sha256,
the compile's configuration and tensorsmith's version; a compile with another key does not read them, and the
next published artifact removes the directory. Model Optimizer's layerwise calibration keeps its finished layers
the same way (`checkpoint_dir`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SUFFIX = ".resume"


def resume_directory(out: Path) -> Path:
    """Where a compile into `out` keeps its finished records: beside it, as its staging directory is."""
    out = out.resolve()
    return out.parent / f".{out.name}{SUFFIX}"


class LayerRecords:
    """Finished results by name (an activation's AWQ scale and clips, its statistics), for one compile key."""

    def __init__(self, root: Path, key_parts: list[str]) -> None:
        digest = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()[:16]
        self.root = root
        self.directory = root / digest
        self.reused = 0  # records read back, for the log and the tests

    def _path(self, name: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        return self.directory / f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.npz"

    def get(self, name: str) -> dict[str, np.ndarray] | None:
        path = self._path(name)
        if not path.is_file():
            return None
        with np.load(path) as stored:
            arrays = {key: stored[key] for key in stored.files}
        self.reused += 1
        return arrays

    def put(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=self.directory, prefix=".partial-", suffix=".npz")
        with os.fdopen(handle, "wb") as file:
            np.savez(file, allow_pickle=True, **arrays)  # numpy's default, named: `**arrays` fills the arrays only
        os.replace(partial, self._path(name))

    def remove(self) -> None:
        """Every compile's records beside this artifact (published: nothing is left to resume)."""
        shutil.rmtree(self.root, ignore_errors=True)
