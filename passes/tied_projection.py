"""A vocabulary projection whose weight is the token embedding table transposed (tied weights: Llama-3.2-1B,
Qwen2.5-0.5B, SmolLM) reads the table through a Transpose, not a transposed copy.

    Gather(E [V, H], ids) … MatMul(hidden, W [H, V])      W == Eᵀ, a second copy of the table
    Gather(E [V, H], ids) … MatMul(hidden, Transpose(E))   one table

The export folds Linear's transpose of the shared parameter into a weight of its own: at the Llama-3.2-1B shape
0.5 GB more of fp16 in the engines' graph, held by TensorRT's builder and written into every plan. TensorRT for
RTX builds the Transpose form with the one table (on the 128256 x 2048 table alone: a 0.53 GB plan and a 1.35 GB
builder, against 1.05 GB and 2.38 GB). ONNX Runtime folds the Transpose back into a copy when a session opens
(the same memory, and 3 s more to open at 1 GB of fp32), so the compile runs this pass on the engines' graphs
only. A weight is taken as the table's transpose only where every value is equal, compared a block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import PassDetails, PassReport, unused_name
from tensorsmith.passes.matching import constant_value

BLOCK_BYTES = 32 << 20  # of the table compared at a time (a weight still in its file is mapped a block at a time)


class TiedProjectionDetails(PassDetails):
    tied: dict[str, str]  # the projection's weight → the table it reads instead


@dataclass
class TiedProjection:
    name: str = "tied_projection"

    def __call__(self, graph: gs.Graph) -> PassReport:
        tables = [node.inputs[0] for node in graph.nodes if _table_gather(node)]
        tied: dict[str, str] = {}
        transposed: dict[str, gs.Variable] = {}
        for node in [node for node in graph.nodes if node.op == "MatMul" and len(node.inputs) == 2]:
            weight = node.inputs[1]
            table = next((t for t in tables if isinstance(weight, gs.Constant) and _transposed(weight, t)), None)
            if table is None:
                continue
            if table.name not in transposed:
                name = unused_name(graph, f"{table.name}/transposed")
                output = gs.Variable(name, table.dtype, [table.shape[1], table.shape[0]])
                graph.nodes.append(gs.Node("Transpose", f"{name}/Transpose", {"perm": [1, 0]}, [table], [output]))
                transposed[table.name] = output
            node.inputs[1] = transposed[table.name]
            tied[weight.name] = table.name
        return PassReport(
            self.name,
            changed=bool(tied),
            counts={"projections_tied": len(tied)},
            details=TiedProjectionDetails(tied=tied),
        )


def _table_gather(node: gs.Node) -> bool:
    """A Gather of rows from a 2-D weight: an embedding table."""
    if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 0 or not node.inputs:
        return False
    table = node.inputs[0]
    return isinstance(table, gs.Constant) and len(table.shape) == 2


def _transposed(weight: gs.Constant, table: gs.Constant) -> bool:
    """Whether `weight` [K, N] is `table` [N, K] transposed, value for value."""
    if len(weight.shape) != 2 or tuple(weight.shape) != tuple(reversed(table.shape)) or weight.dtype != table.dtype:
        return False
    rows = int(table.shape[0])
    step = max(1, BLOCK_BYTES // max(1, int(table.shape[1]) * _itemsize(table)))
    for start in range(0, rows, step):
        # each block's maps are made here and dropped with them: the compared pages do not stay resident
        block, columns = constant_value(table), constant_value(weight)
        assert block is not None and columns is not None
        if not np.array_equal(block[start : start + step], columns[:, start : start + step].T):
            return False
    return True


def _itemsize(constant: gs.Constant) -> int:
    """Bytes a value: onnx-graphsurgeon gives a bf16 weight's dtype as ONNX's type number (numpy has no bf16)."""
    dtype = constant.dtype
    return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype) if isinstance(dtype, int) else dtype).itemsize)
