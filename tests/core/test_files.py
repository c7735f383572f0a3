"""core/files.py's writes fail as the file system does, so that a full disk is named in one line."""

from __future__ import annotations

import errno
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tensorsmith.core.files import write_array


def test_a_full_disk_is_an_oserror_with_its_errno() -> None:
    """/dev/full refuses every write with ENOSPC: write_array passes it on; ndarray.tofile, which the writers used,
    raises an OSError without errno ("Not enough free space to write …"), which the staging cannot recognise."""
    values = np.ones(1 << 16, np.float32)
    with open("/dev/full", "wb", buffering=0) as stream, pytest.raises(OSError) as raised:
        write_array(values, stream)
    assert raised.value.errno == errno.ENOSPC
    with open("/dev/full", "wb", buffering=0) as stream, pytest.raises(OSError) as untold:
        values.tofile(stream)
    assert untold.value.errno is None


def test_the_bytes_are_tofile_s_for_any_dtype(tmp_path: Path) -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4).T.astype(ml_dtypes.bfloat16)  # not C-contiguous
    with open(tmp_path / "ours", "wb") as stream:
        write_array(values, stream)
    np.ascontiguousarray(values).tofile(tmp_path / "numpy")
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "numpy").read_bytes()
