"""Files written whole or not at all: a temporary file beside the target, fsynced, then renamed over it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO

import numpy as np


def current_umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: readers see the old file or the new one, never a part."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.chmod(stream.name, 0o666 & ~current_umask())
    os.replace(stream.name, path)


def write_array(array: np.ndarray, stream: BinaryIO) -> None:
    """`array`'s bytes (C order, any dtype: bfloat16 and float8 too) at `stream`'s position, as ndarray.tofile writes
    them, but failing as the file system does: tofile turns a full disk into an OSError without errno, which the
    compile's staging (compiler/artifact/staging.py) could not tell from another error and name the file."""
    stream.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
