"""onnx-ir models whose weights refer to a checkpoint's files (core/checkpoint_references.py): saved with those
weights as references, and read back with each one an fp32 weight that reads its bytes only when a pass needs them.

The export's weights carry their Reference in their metadata (REFERENCE_KEY); so do the weights `referring_model`
makes of a saved graph's references, so that canonicalize saves them as references again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from tensorsmith.core.checkpoint_references import REFERENCE_KEY, Reference, take_references, write_references
from tensorsmith.core.ir import save_ir

if TYPE_CHECKING:
    import onnx_ir as ir

# What a weight's REFERENCE_KEY metadata holds: its Reference, and the check of its checkpoint bytes (None: none)
Referred = tuple[Reference, Callable[[], object] | None]


def referred(model: ir.Model) -> dict[str, Referred]:
    """The main graph's weights that carry a Reference, by name: (the Reference, its check or None)."""
    found: dict[str, Referred] = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is not None and (meta := tensor.meta.get(REFERENCE_KEY)) is not None:
            found[name] = meta
    return found


def save_referring(model: ir.Model, path: Path) -> onnx.ModelProto:
    """Save the onnx-ir `model` at `path` with each weight that carries a Reference stored as one (its check run
    first: a NaN in the checkpoint is refused here, naming the tensor); the other weights as save_ir writes them.
    The structure written."""
    import onnx_ir as ir

    references = referred(model)
    held = {}
    for name, (_, check) in references.items():
        if check is not None:
            check()
        value = model.graph.initializers[name]
        held[name], value.const_value = value.const_value, ir.tensor(np.zeros(0, np.float32), name=name)
    try:
        save_ir(model, path)
    finally:
        for name, tensor in held.items():
            model.graph.initializers[name].const_value = tensor
    structure = onnx.load(str(path), load_external_data=False)
    write_references(structure, {name: reference for name, (reference, _) in references.items()}, path)
    path.write_bytes(structure.SerializeToString())
    return structure


def referring_model(structure: onnx.ModelProto, base: Path) -> ir.Model:
    """The onnx-ir model of `structure` (saved in `base`, or with absolute locations), each weight it reads by
    reference an fp32 initializer read from the checkpoint when a pass reads it. `structure` is left as it was."""
    import onnx_ir as ir

    copied = onnx.ModelProto()
    copied.CopyFrom(structure)
    references = take_references(copied, base)
    for name, reference in references.items():  # typed placeholders, never read: replaced below
        placeholder = onnx.TensorProto(name=name, dims=list(reference.graph_shape), data_type=onnx.TensorProto.FLOAT)
        placeholder.data_location = onnx.TensorProto.EXTERNAL
        placeholder.external_data.add(key="location", value=str(reference.file))
        copied.graph.initializer.append(placeholder)
    model = ir.from_proto(copied)
    for name, reference in references.items():
        model.graph.initializers[name].const_value = lazy_reference(reference, name)
    return model


def lazy_reference(reference: Reference, name: str) -> ir.LazyTensor:
    """An onnx-ir fp32 tensor of the referenced weight, read when a stage reads it, carrying its Reference."""
    import onnx_ir as ir

    tensor = ir.LazyTensor(
        lambda: ir.tensor(reference.values()), dtype=ir.DataType.FLOAT, shape=ir.Shape(reference.graph_shape), name=name
    )
    tensor.meta[REFERENCE_KEY] = (reference, None)
    return tensor
