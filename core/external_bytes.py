"""A weight's bytes in an ONNX external-data file: where they lie, written again in 16 bits where 16 bits hold
them exactly, copied as they are, and a tensor pointed at its new place. Read a chunk at a time, never mapped:
the pages go to the page cache, not to the process's memory."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx

from tensorsmith.core.files import write_array
from tensorsmith.core.mapped_graph import MappedValues
from tensorsmith.runtime.manifest import external_data_path

CHUNK = 16 << 20  # float32 values read at a time while a weight is checked and converted


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def external_bytes(tensor: onnx.TensorProto, directory: Path) -> MappedValues:
    """Where a weight's stored bytes lie (file, offset, length), as core/mapped_graph reads them."""
    location = next(entry.value for entry in tensor.external_data if entry.key == "location")
    return MappedValues(tensor, directory / location)


def _chunks(offset: int, length: int) -> list[tuple[int, int]]:
    """(offset, count) of each CHUNK of 4-byte values in the `length` bytes at `offset`."""
    count = length // 4
    return [(offset + start * 4, min(CHUNK, count - start)) for start in range(0, count, CHUNK)]


def write_narrow(source: Path, offset: int, length: int, stream: BinaryIO) -> int | None:
    """Write the float32 weight's values in 16 bits and return the type: BFLOAT16 where every value's low 16 bits
    are zero, else FLOAT16 where float16 holds every value exactly (a NaN never compares equal: kept fp32);
    None, with nothing written, where neither holds them. Read a chunk at a time, never mapped: the pages go to
    the page cache, not to the process's memory."""
    start = stream.tell()
    for kind in (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16):
        for at, count in _chunks(offset, length):
            bits = np.fromfile(source, np.uint32, count, offset=at)
            if kind == onnx.TensorProto.BFLOAT16:
                narrow = (bits >> 16).astype(np.uint16)
                exact = not np.any(bits & 0xFFFF)
            else:
                with np.errstate(over="ignore"):
                    narrow = bits.view(np.float32).astype(np.float16)
                exact = np.array_equal(narrow.astype(np.float32), bits.view(np.float32))
            if not exact:
                stream.seek(start)
                stream.truncate()
                break
            write_array(narrow, stream)
        else:
            return kind
    return None


def copy_bytes(source: Path, offset: int, length: int, stream: BinaryIO) -> None:
    with source.open("rb") as original:
        original.seek(offset)
        remaining = length
        while remaining:
            block = original.read(min(remaining, CHUNK))
            stream.write(block)
            remaining -= len(block)


def point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def graph_bytes(path: Path) -> int:
    """An ONNX file's bytes with its external data's."""
    sidecar = external_data_path(path)
    return path.stat().st_size + (sidecar.stat().st_size if sidecar.is_file() else 0)
