"""A decoder's weights read from its checkpoint one tensor at a time, never as a float32 module.

transformers builds a checkpoint's module in float32 (the reference the compile is measured against): at
Llama-3.1-8B's shape 32 GB, on a 24 GB machine, before the export even starts. A decoder whose layers are stamped
(layer_stamping.py) needs no weight to be traced: its module is built with *empty* parameters (float32 tensors
whose memory is never touched, so it is never resident), traced, and every weight of the exported graph is an
onnx-ir LazyTensor that reads its tensor from the memory-mapped safetensors shard, widened to float32, only when a
stage writes or reads it, and drops it after. The torch reference that verification runs goes the same way: each
module's own parameters are read from the checkpoint just before it runs and released after
(`module_weights.weights_while_running`), so at most one module's weights are float32 at a time.

Every tensor read is checked for NaN and infinity, naming the tensor and its file: a checkpoint with corrupted
bytes is refused as it is read, at no pass of its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from tensorsmith.core.checkpoint_references import REFERENCE_KEY, WIDENED, Reference
from tensorsmith.core.errors import ExportError
from tensorsmith.core.importing import first_line

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SHARD_INDEX = "model.safetensors.index.json"
FLOAT_CODES = ("F16", "BF16", "F32", "F64")  # safetensors' dtype codes of the float weights read as float32
CHECK_BYTES = 64 << 20  # of a stored weight checked for NaN at a time


class CheckpointWeights:
    """The tensors of a model directory's safetensors files (one file, or the shards an index names), by name,
    read on demand as float32 numpy arrays."""

    def __init__(self, directory: Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.directory = directory
        self.on_read: Callable[[], None] = lambda: None  # told of each tensor read (the export's progress)
        owner = shard_owner(directory)
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._codes: dict[str, str] = {}  # safetensors' dtype codes
        self._places: dict[str, tuple[int, int]] = {}  # each tensor's (offset, length) in its file
        for path in sorted(directory.glob("*.safetensors")):
            try:
                self._places.update(data_places(path))
                with safe_open(str(path), framework="numpy") as opened:  # the headers only: no torch to import
                    for name in opened.keys():  # noqa: SIM118 (not iterable)
                        if owner is None or owner.get(name) == path.name:
                            piece = opened.get_slice(name)
                            self._files[name], self._codes[name] = path, piece.get_dtype()
                            self._shapes[name] = tuple(int(d) for d in piece.get_shape())
            except (SafetensorError, OSError, ValueError) as err:
                raise ExportError(f"checkpoint {path} is not a valid safetensors file: {first_line(err)}") from err

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def stands_for(self) -> dict[str, tuple[str, ...]]:
        """Float weights read dequantized from stored codes, each with the stored tensors it stands for (a
        pre-quantized checkpoint's); none here."""
        return {}

    def dtype_code(self, name: str) -> str:
        """safetensors' dtype code of a tensor ("BF16", "I32", …), from the header."""
        return self._codes[name]

    def files(self) -> list[Path]:
        return sorted(set(self._files.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def float_parameters(self) -> int:
        """The float weights' count, from the headers alone."""
        return sum(
            int(np.prod(self._shapes[name], dtype=np.int64))
            for name, code in self._codes.items()
            if code in FLOAT_CODES
        )

    def largest_float(self) -> int:
        """The most elements one float weight holds (the vocabulary tables, in a decoder), from the headers."""
        return max(
            (
                int(np.prod(self._shapes[name], dtype=np.int64))
                for name, code in self._codes.items()
                if code in FLOAT_CODES
            ),
            default=0,
        )

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as stored, floats widened to float32; NaN or infinity refused, naming the tensor."""
        import torch
        from safetensors import safe_open

        # The shard is mapped for this read only: a mapped page read stays resident while its file is open (every
        # weight's bf16 bytes by the end of an 8B export), and pread, which maps nothing, copied into fresh memory
        # at a third of the speed (1B: 9-11 s against 3.2-3.7 s). The copy is made before the map goes.
        with safe_open(str(self._files[name]), framework="pt") as opened:
            stored = opened.get_tensor(name)
            copied = stored.to(torch.float32, copy=True) if stored.is_floating_point() else stored.clone()
        del stored
        self.on_read()
        if not copied.is_floating_point():
            return copied
        # a NaN or an infinity anywhere makes the sum one: a single pass, no mask (isfinite over every value took
        # 0.77 s for 262M values); the values are counted only then (a finite sum can overflow, in theory)
        if not bool(torch.isfinite(copied.sum())):
            self._refuse_nonfinite(name, int((~torch.isfinite(copied)).sum()))
        return copied

    def _refuse_nonfinite(self, name: str, bad: int) -> None:
        if bad:
            raise ExportError(
                f"checkpoint tensor {name} in {self._files[name]} holds {bad} NaN or infinite values",
                hint="the file is damaged or the training diverged: re-download or re-save it",
            )

    def array(self, name: str) -> np.ndarray:
        return self.tensor(name).numpy()

    def lazy(self, name: str, graph_name: str, referable: bool = False) -> ir.TensorProtocol:
        """The checkpoint's `name` as an onnx-ir tensor named `graph_name`: a float weight is read (as float32)
        when a stage reads or writes it; an integer buffer (small) at once. `referable`: a float weight the graph
        may store as a reference to its bytes (core/checkpoint_references.py) carries where they are."""
        if self._codes[name] not in FLOAT_CODES:
            return ir.tensor(self.array(name), name=graph_name)
        tensor = ir.LazyTensor(
            lambda: ir.tensor(self.array(name)),
            dtype=ir.DataType.FLOAT,
            shape=ir.Shape(self.shape(name)),
            name=graph_name,
        )
        if referable and self._codes[name] in WIDENED:
            tensor.meta[REFERENCE_KEY] = (self._reference(name), lambda: self.check(name))
        return tensor

    def _reference(self, name: str) -> Reference:
        """Where the stored bytes of float weight `name` are (core/checkpoint_references.py)."""
        offset, length = self._places[name]
        return Reference(self._files[name], offset, length, WIDENED[self._codes[name]], self.shape(name))

    def check(self, name: str) -> None:
        """Refuse the stored `name` if it holds NaN or infinity (read a block at a time, as stored), naming it."""
        reference = self._reference(name)
        rows = reference.shape[0] if reference.shape else 1
        step = max(1, (CHECK_BYTES * rows) // max(1, reference.length))
        bad = 0
        for start in range(0, rows, step):
            block = reference.values(start, min(rows, start + step))
            if not np.isfinite(block.sum(dtype=np.float32)):
                bad += int((~np.isfinite(block)).sum())
        self.on_read()
        self._refuse_nonfinite(name, bad)


def data_places(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's (offset, length) in the safetensors file at `path`, from its header (8 bytes of the header's
    length, the JSON header, then the data its `data_offsets` count from)."""
    with path.open("rb") as stream:
        size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(size))
    start = 8 + size
    return {
        name: (start + int(entry["data_offsets"][0]), int(entry["data_offsets"][1]) - int(entry["data_offsets"][0]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


def shard_owner(directory: Path) -> dict[str, str] | None:
    """A sharded checkpoint's index: the file that holds each tensor (None for a single file)."""
    index = directory / SHARD_INDEX
    return dict(json.loads(index.read_text())["weight_map"]) if index.is_file() else None
