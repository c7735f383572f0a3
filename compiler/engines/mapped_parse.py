"""TensorRT's ONNX parser given the graph's weights as read-only maps of their file, whose pages this process lets
go of while the builder runs.

Parsed from the file, a build holds every weight twice until it ends: the parser's copy and the engine's. (At the
Llama-3.2-1B shape the fp16 graph's 3.0 GB made a 7.7 GB builder, and a 1.07 GB chain of MatMuls a 2.46 GB one.)
Given the weights through `IParser.load_initializer` as addresses in a read-only map of the `.data` file, the
parser copies nothing; the builder reads each weight from the map to make its own copy. Those mapped pages are
the page cache's, and `shedding()` drops them from this process every SHED_SECONDS (madvise MADV_DONTNEED: a
later read faults the same bytes back from the cache, so TensorRT sees the file's values whatever it reads when).
The 1.07 GB chain then peaks at 1.58 GB, with a plan identical byte for byte.

A parser without `load_initializer` (older data-centre TensorRT), a graph without external weights, or a tensor
whose length is not written falls back to `parse_from_file`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import onnx

from tensorsmith.core.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt_api  # tensorrt-stubs (builder.py)

logger = logging.getLogger(__name__)

SHED_SECONDS = 0.05
PARSER_ERRORS_SHOWN = 5


@dataclass
class MappedWeights:
    """The read-only maps a parser's initializers point into; empty where the parser read the file itself."""

    maps: list[mmap.mmap] = field(default_factory=list)
    _views: list[np.ndarray] = field(default_factory=list)  # their addresses: numpy's view of each map

    def address(self, file: Path) -> int:
        """The address of `file`'s first byte in a read-only map of it, made on first use."""
        with file.open("rb") as stream:
            mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(mapped, np.uint8)
        self.maps.append(mapped)
        self._views.append(view)
        return int(view.ctypes.data)

    @contextlib.contextmanager
    def shedding(self) -> Iterator[None]:
        """While the block runs, drop the mapped pages from this process every SHED_SECONDS."""
        if not self.maps or not hasattr(mmap, "MADV_DONTNEED"):
            yield
            return
        stop = threading.Event()

        def shed() -> None:
            while not stop.wait(SHED_SECONDS):
                for mapped in self.maps:
                    mapped.madvise(mmap.MADV_DONTNEED)

        thread = threading.Thread(target=shed, name="tensorsmith-shed-weights", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        self._views.clear()  # numpy's views first: a map with views cannot close
        for mapped in self.maps:
            mapped.close()
        self.maps.clear()


def _external_weights(structure: onnx.ModelProto, directory: Path) -> dict[str, tuple[Path, int, int]] | None:
    """name → (file, offset, length) of every initializer stored outside the protobuf; None where one has no
    length written (the parser then reads the file itself)."""
    found: dict[str, tuple[Path, int, int]] = {}
    for tensor in structure.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        fields = {entry.key: entry.value for entry in tensor.external_data}
        if "length" not in fields:
            return None
        if int(fields["length"]):  # an empty one has no bytes to map (and an empty file cannot be mapped)
            found[tensor.name] = (directory / fields["location"], int(fields.get("offset", 0)), int(fields["length"]))
    return found


@contextlib.contextmanager
def parsed_network(
    trt: ModuleType, builder: trt_api.Builder, trt_logger: trt_api.ILogger, onnx_path: Path, flags: int
) -> Iterator[tuple[trt_api.INetworkDefinition, MappedWeights]]:
    """A network parsed from `onnx_path`, and the maps its weights point into (kept, with the parser, for the
    block: build inside it, under `weights.shedding()`, and let go of the network before the block ends)."""
    network = builder.create_network(flags)
    parser: trt_api.OnnxParser = trt.OnnxParser(network, trt_logger)
    weights = MappedWeights()
    try:
        structure = onnx.load(str(onnx_path), load_external_data=False)
        external = _external_weights(structure, onnx_path.parent)
        if external and hasattr(parser, "load_initializer"):
            ok = parser.load_model_proto(structure.SerializeToString(), str(onnx_path))
            del structure
            sizes = {file: file.stat().st_size if file.is_file() else -1 for file, _, _ in external.values()}
            for name, (file, offset, length) in external.items():  # a read past a map's end would be a SIGBUS
                if offset + length > sizes[file]:
                    raise BuildError(
                        f"weight '{name}' of {onnx_path.name} lies past the end of {file} "
                        f"(bytes {offset}-{offset + length}, the file has {max(sizes[file], 0)})",
                        hint="the graph's external data file is missing or truncated: compile it again",
                    )
            addresses = {file: weights.address(file) for file in sizes}
            for name, (file, offset, length) in external.items():
                if ok and not parser.load_initializer(name, addresses[file] + offset, length):
                    raise BuildError(
                        f"TensorRT's parser refused the bytes of weight '{name}' in {file}",
                        hint="the graph's external data does not match its tensors: compile it again",
                    )
            ok = ok and parser.parse_model_proto()
        else:
            ok = parser.parse_from_file(str(onnx_path))
        if not ok:
            raise _parse_error(parser, onnx_path)
        logger.debug("parsed %s: %d weights mapped", onnx_path.name, len(external or {}) if weights.maps else 0)
        yield network, weights
    finally:
        del parser, network  # before the maps they point into
        weights.close()


def _parse_error(parser: trt_api.OnnxParser, onnx_path: Path) -> BuildError:
    errors = [parser.get_error(i) for i in range(parser.num_errors)]
    described = [f"node '{error.node_name()}' ({error.node_operator()}): {error.desc().strip()}" for error in errors]
    more = f" … and {len(described) - PARSER_ERRORS_SHOWN} more" if len(described) > PARSER_ERRORS_SHOWN else ""
    return BuildError(
        f"TensorRT could not parse {onnx_path}: {'; '.join(described[:PARSER_ERRORS_SHOWN])}{more}",
        hint="these nodes use ops or types TensorRT's ONNX parser does not support; `tensorsmith inspect` lists ops",
    )
