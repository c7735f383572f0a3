"""Arrays a long stage does not read, held on disk instead of in the process's memory.

At Llama-3.1-8B's shape the fp32 graph's outputs on the evaluation windows (the logits and every layer's keys and
values: 0.8 GB) wait through AWQ's statistics and search, the compile's peak, before any variant is measured against
them. Written to a file and mapped back read-only, they hold no memory until read; the file is unlinked at once, so
the mapping keeps its bytes until the arrays are dropped and nothing is left on disk after.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def spilled(arrays: Sequence[np.ndarray], directory: Path) -> list[np.ndarray]:
    """`arrays` as read-only arrays mapped from files written in `directory` (already unlinked): the same values;
    the caller drops its own arrays for the memory to be given back."""
    mapped = []
    for array in arrays:
        handle, name = tempfile.mkstemp(dir=directory, prefix=".spilled-", suffix=".npy")
        try:
            with os.fdopen(handle, "wb") as file:
                np.save(file, np.ascontiguousarray(array), allow_pickle=False)
            mapped.append(np.load(name, mmap_mode="r"))
        finally:
            Path(name).unlink(missing_ok=True)
    return mapped
