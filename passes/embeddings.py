"""Store large embedding tables in int8, weight-only: one scale per row, dequantized before the Gather.

    table (int8 [V, D]) ──► DequantizeLinear(s[V], 0, axis=0) ──► Gather(ids) ──► (float)      TensorRT
    table (int8) ──► Gather(ids) ──► Cast ──► Mul ◄── Unsqueeze ◄── Gather(s[V], ids)              ONNX Runtime

The first form is what TensorRT folds at build time (it keeps the table in int8 in the engine). ONNX Runtime
does not fold a DequantizeLinear of an initializer, so it would dequantize the whole table on every run; for
the cpu variants (`gather_first=True`) the rows are gathered in int8 and only they are scaled.

A vocabulary table is most of what is left of a quantized transformer's file (MiniLM: 23 MB of 35 in fp16).
A row is one token's vector, so a scale per row keeps each token's relative error at the int8 step of its own
largest element. Only tables with at least `min_rows` rows (vocabularies, not position tables) are touched;
the compiler applies this under `--precision auto` only, where the budget is verified with it (the default
policy keeps embeddings in higher precision).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.precisions import INT8
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.int4 import int4_constant, quantize_int4
from tensorsmith.passes.matching import constant_value
from tensorsmith.passes.quantize import quantize_weights

MIN_ROWS = 1024


class EmbeddingDetails(PassDetails):
    tables: list[str]  # the vocabulary tables quantized


@dataclass
class QuantizeEmbeddings:
    min_rows: int = MIN_ROWS
    gather_first: bool = False  # scale the gathered rows (ONNX Runtime) instead of dequantizing the table
    int4: bool = False  # the dequantized form in INT4, blockwise along a row (int4 variants for TensorRT)
    tie: bool = True  # with int4: an output projection tied to the table reads the INT4 table too
    name: str = "quantize_embeddings"

    def __call__(self, graph: gs.Graph) -> PassReport:
        quantized, saved, tied = [], 0, 0
        for node in [node for node in graph.nodes if node.op == "Gather"]:
            table = node.inputs[0]
            if not (isinstance(table, gs.Constant) and len(table.shape) == 2 and node.attrs.get("axis", 0) == 0):
                continue
            values = constant_value(table)
            assert values is not None
            if values.dtype not in (np.float32, np.float16) or values.shape[0] < self.min_rows:
                continue
            codes, scales = quantize_weights(values, axis=0, precision=INT8.name)
            prefix = f"{table.name}/int8"
            if self.gather_first:
                readers = list(table.outputs)
                if not all(user.op == "Gather" and user.attrs.get("axis", 0) == 0 for user in readers):
                    continue  # read by something else too: leave it whole
                stored = gs.Constant(f"{prefix}/quantized", codes)
                row_scales = gs.Constant(f"{prefix}/scale", scales.astype(values.dtype))
                for reader in readers:
                    _scale_after_gather(graph, reader, stored, row_scales)
                quantized.append(table.name)
                saved += values.nbytes - codes.nbytes - scales.nbytes
                continue
            if self.int4 and (block := row_block(values.shape[1])):
                (dequantized,), stored = _int4_table(graph, table.name, values, block)
                saved += codes.nbytes - stored  # (the int8 figures are subtracted below)
                for projection in tied_projections(graph, values) if self.tie else []:  # one table, as the model ties
                    (transposed,) = graph.layer(
                        op="Transpose",
                        name=f"{projection.name}/tied",
                        attrs={"perm": [1, 0]},
                        inputs=[dequantized],
                        outputs=[f"{projection.name}/tied_weight"],
                    )
                    transposed.dtype = values.dtype
                    saved += values.nbytes
                    projection.inputs[1] = transposed
                    tied += 1
            else:
                (dequantized,) = graph.layer(
                    op="DequantizeLinear",
                    name=f"{prefix}/DequantizeLinear",
                    attrs={"axis": 0},
                    inputs=[
                        gs.Constant(f"{prefix}/quantized", codes),
                        gs.Constant(f"{prefix}/scale", scales.astype(values.dtype)),
                        gs.Constant(f"{prefix}/zero_point", np.zeros(scales.shape, np.int8)),
                    ],
                    outputs=[f"{prefix}/dequantized"],
                )
            dequantized.dtype = values.dtype
            for user in list(table.outputs):  # every reader of the table (a tied output projection too)
                user.inputs[user.inputs.index(table)] = dequantized
            quantized.append(table.name)
            saved += values.nbytes - codes.nbytes - scales.nbytes
        graph.cleanup()
        # a tied projection's INT4 is this pass's (the INT4 pass leaves it to it): counted, as precision.json has it
        tied_count = {"projections_tied": tied} if self.int4 else {}
        counts = {"tables_quantized": len(quantized), **tied_count, "bytes_saved": int(saved)}
        return PassReport(self.name, changed=bool(quantized), counts=counts, details=EmbeddingDetails(tables=quantized))


def tied_projections(graph: gs.Graph, table: np.ndarray) -> list[gs.Node]:
    """MatMuls whose constant weight is `table` transposed: an output projection tied to the vocabulary table
    (`tie_word_embeddings`), which exporters store as a second copy."""
    found = []
    for node in graph.nodes:
        weight = node.inputs[1] if node.op == "MatMul" else None
        if not isinstance(weight, gs.Constant) or tuple(weight.shape) != table.shape[::-1]:
            continue
        values = constant_value(weight)  # read only where the shape fits
        if values is not None and np.array_equal(values, table.T):
            found.append(node)
    return found


def row_block(width: int) -> int | None:
    """Blocks of 32 values per scale along a row: a table has no activation to scale for, and on tinylm block 32
    kept the perplexity ratio 0.008 lower than 128 for 3 % more bytes (measured)."""
    return next((block for block in (32, 64, 128) if width % block == 0), None)


def _int4_table(graph: gs.Graph, name: str, values: np.ndarray, block: int) -> tuple[list[gs.Variable], int]:
    """DequantizeLinear(INT4 table, scale per `block` of a row, axis 1) (TensorRT for RTX builds it before a Gather
    for sm_86, checked); returns its output and the bytes stored."""
    q, scale = quantize_int4(np.asarray(values, np.float32).T, block)  # blocks along a row: the transposed K axis
    prefix = f"{name}/int4"
    outputs = graph.layer(
        op="DequantizeLinear",
        name=f"{prefix}/DequantizeLinear",
        attrs={"axis": 1, "block_size": block},
        inputs=[
            int4_constant(f"{prefix}/quantized", q.T),
            gs.Constant(f"{prefix}/scale", scale.T.astype(values.dtype)),
            int4_constant(f"{prefix}/zero_point", np.zeros(scale.T.shape, np.int8)),
        ],
        outputs=[f"{prefix}/dequantized"],
    )
    return outputs, q.size // 2 + scale.nbytes


def _scale_after_gather(graph: gs.Graph, reader: gs.Node, table: gs.Constant, scale_vector: gs.Constant) -> None:
    """Replace `reader` (a Gather of the float table) by Gather(int8 table) · Gather(scales)[..., None]."""
    ids, (output,) = reader.inputs[1], reader.outputs
    name = f"{reader.name}/int8"
    dtype = scale_vector.values.dtype
    (gathered,) = graph.layer(
        op="Gather", name=f"{name}/codes", attrs={"axis": 0}, inputs=[table, ids], outputs=[f"{name}/codes"]
    )
    (row_scales,) = graph.layer(
        op="Gather", name=f"{name}/scales", attrs={"axis": 0}, inputs=[scale_vector, ids], outputs=[f"{name}/scales"]
    )
    (widened,) = graph.layer(
        op="Cast", name=f"{name}/cast", attrs={"to": onnx_type(dtype)}, inputs=[gathered], outputs=[f"{name}/float"]
    )
    (column,) = graph.layer(
        op="Unsqueeze",
        name=f"{name}/unsqueeze",
        inputs=[row_scales, gs.Constant(f"{name}/last_axis", np.array([-1], np.int64))],
        outputs=[f"{name}/column"],
    )
    gathered.dtype, row_scales.dtype, widened.dtype, column.dtype = np.int8, dtype, dtype, dtype
    reader.outputs.clear()
    graph.layer(op="Mul", name=f"{name}/scale", inputs=[widened, column], outputs=[output])


def onnx_type(dtype: np.dtype) -> int:
    from onnx import helper

    return int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
