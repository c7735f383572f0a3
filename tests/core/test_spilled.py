"""Arrays spilled to disk (core/spilled.py): the same values, read-only, no memory held until read, no file left."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tensorsmith.core.memory import current_rss
from tensorsmith.core.spilled import spilled

MB = 1 << 20


def test_spilled_arrays_keep_their_values_and_give_their_memory_back(tmp_path: Path) -> None:
    array = np.empty((64, 4 * MB // 4), np.float32)  # 256 MB, every page touched
    array[:] = np.arange(array.shape[1], dtype=np.float32)
    small = np.arange(12, dtype=np.int64).reshape(3, 4)
    held = current_rss()
    (mapped, again) = spilled([array, small], tmp_path)
    del array
    freed = current_rss()
    assert held is not None and freed is not None and held - freed > 200 * MB  # the 256 MB are not held
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left however the compile ends
    assert not mapped.flags.writeable and mapped.shape == (64, MB) and mapped.dtype == np.float32
    assert mapped[63, 12345] == 12345 and np.array_equal(again, small)
