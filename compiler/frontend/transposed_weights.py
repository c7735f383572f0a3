"""A weight read through a Transpose is written transposed when the export is first saved.

The dynamo exporter writes every nn.Linear as MatMul(x, Transpose(W)), W an initializer. Canonicalize's constant
folding would turn each into a transposed copy afterwards: at the SmolLM-135M shape, 425 MB of new arrays held at
once, and every weight written a second time (the export's file, then canonicalize's). Folded here instead, each
transpose is an onnx-ir LazyTensor, computed one at a time as the export is saved, so the exported file already
holds the weights as every later stage reads them, and canonicalize keeps that file (passes/canonicalize.py).

The folded value keeps the Transpose output's name, as onnxscript's folding names it; a weight read elsewhere too
(a tied embedding table, gathered as well as projected) is kept beside its transpose.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from tensorsmith.core.checkpoint_references import REFERENCE_KEY

if TYPE_CHECKING:
    import onnx_ir as ir

CHUNK_BYTES = 1 << 20  # of the transposed weight copied at a time: under numpy's huge-page threshold (4 MB)


def _transposed(tensor: ir.TensorProtocol, perm: list[int]) -> ir.TensorProtocol:
    import onnx_ir as ir

    return ir.tensor(np.ascontiguousarray(np.transpose(tensor.numpy(), perm)))


def _lazy_transpose(tensor: ir.TensorProtocol, perm: list[int], name: str | None) -> ir.LazyTensor:
    """`tensor` transposed by `perm`, computed when read; a 2-D one is written a few rows at a time through one
    small buffer. A whole transposed copy per weight is fresh memory each time (numpy asks for huge pages, whose
    first touch this machine makes slow: 425 MB of them cost more system time than the copies saved), and a
    strided view written as it is goes element by element (2.7 s of user time at the 135M shape)."""
    import onnx_ir as ir

    class TransposedWeight(ir.LazyTensor):
        def tofile(self, file: BinaryIO) -> None:
            if perm != [1, 0]:
                super().tofile(file)
                return
            source = tensor.numpy()  # [N, K]: written as [K, N]
            columns, rows = source.shape
            step = max(1, CHUNK_BYTES // max(1, columns * source.itemsize))
            buffer = np.empty((step, columns), source.dtype)
            for start in range(0, rows, step):
                part = buffer[: min(step, rows - start)]
                np.copyto(part, source[:, start : start + step].T)
                file.write(part.view(np.uint8).data)  # any dtype (bfloat16 too), any file object

    dims = tensor.shape.numpy()  # a tensor's: all known
    shape = ir.Shape([dims[axis] for axis in perm])
    transposed = TransposedWeight(
        functools.partial(_transposed, tensor, perm), dtype=tensor.dtype, shape=shape, name=name
    )
    if (referred := tensor.meta.get(REFERENCE_KEY)) is not None:  # still the checkpoint's bytes, read transposed
        reference, check = referred
        transposed.meta[REFERENCE_KEY] = (reference.transposed(perm), check)
    return transposed


def fold_weight_transposes(model: ir.Model) -> int:
    """Replace each Transpose of an initializer in `model`'s main graph (onnx-ir) by a lazily transposed initializer;
    the number folded. Weights left unread are removed."""
    import onnx_ir as ir

    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            continue
        source, output = node.inputs[0], node.outputs[0]
        if (
            source is None
            or not source.is_initializer()
            or source.name is None  # never, for an initializer (the pop below takes its name)
            or source.const_value is None
            or output.is_graph_output()
        ):
            continue
        tensor = source.const_value
        rank = len(tensor.shape)
        attribute = node.attributes.get("perm")
        perm = list(attribute.as_ints()) if attribute is not None else list(reversed(range(rank)))
        name = output.name
        lazy = _lazy_transpose(tensor, perm, name)
        value = ir.Value(name=name, shape=lazy.shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
        output.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        graph.register_initializer(value)
        if not source.uses() and not source.is_graph_output():
            graph.initializers.pop(source.name)
        folded += 1
    return folded
