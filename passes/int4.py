"""INT4 weight-only quantization in the form TensorRT takes (REFERENCE.md; checked with TensorRT for RTX):

    W [K, N] ──► W_q INT4 [K, N] (packed initializer), s [K/B, N] ──► DequantizeLinear(axis 0, block_size B,
                                                                       zero point 0) ──► MatMul(x, ·)

Blocks of B rows run along the input dimension K; symmetric, q = clip(round(w / s), -8, 7) with s = clip·amax/7.5
per block and output column (`clip` < 1 is AWQ's clipping search, 1 is round-to-nearest). AWQ's per-input-channel
scales t (W' = diag(t)·W, x' = x/t) are applied here too: 1/t folded into the normalization that computes x when
it is the only reader (RMSNorm's or LayerNorm's γ, and β), else an explicit Mul that the MatMuls share. Only
standard ops, opset 21: ONNX Runtime's CPU provider fuses the DequantizeLinear → MatMul pair into MatMulNBits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.formats import absolute_max
from tensorsmith.core.grouped_int4 import GroupedInt4
from tensorsmith.core.mapped_graph import reads_rows
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.int4_codes import Int4Codes, codes
from tensorsmith.passes.matching import constant_value

# A block's amax maps to ±7.5, so that rounding uses all 16 levels (-8 for a negative max, 7 clipped for a positive
# one), as ONNX Runtime's MLAS quantizer does; amax/7 leaves -8 unused: on tinylm, round-to-nearest's perplexity
# ratio went from 1.105 to 1.057 with this alone (measured, docs/design-notes.md).
AMAX_LEVEL = 7.5
SMALLER_BLOCKS = (64, 32, 16)  # for a weight whose K the block does not divide (TensorRT takes whole blocks only)
NORMALIZATIONS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")


def layer_block(rows: int, block: int) -> int | None:
    """The block a weight of `rows` input rows is quantized in: `block`, else the largest smaller one that divides
    them (SmolLM's K = 576 takes 64 where 128 was asked); None when not even 16 does. TensorRT's parser refuses a
    last partial block ("The quantization axis must divide into whole blocks", checked with tensorrt-rtx 1.7)."""
    for candidate in (block, *(size for size in SMALLER_BLOCKS if size < block)):
        if rows % candidate == 0:
            return candidate
    return None


def block_amax(weight: np.ndarray, block: int) -> np.ndarray:
    """max |w| per block of `block` rows and column: [K/B, N]."""
    rows, columns = weight.shape
    return absolute_max(weight.reshape(rows // block, block, columns), axis=1)


def block_step(amax: np.ndarray) -> np.ndarray:
    """The quantization step of each block from its (clipped) amax: amax/7.5, 1 for an all-zero block."""
    return np.where(amax > 0, amax / AMAX_LEVEL, 1.0).astype(np.float32)


def int4_scale(weight: np.ndarray, block: int, clip: np.ndarray | None = None) -> np.ndarray:
    """The step of each block of `weight` [K, N]: [K/B, N] float32; `clip` [K/B, N] scales the amax."""
    return block_step(block_amax(weight, block) * (1.0 if clip is None else clip))


def quantize_int4(weight: np.ndarray, block: int, clip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 in [-8, 7] [K, N], scale float32 [K/B, N]) of `weight` [K, N]; `clip` [K/B, N] scales the amax."""
    scale = int4_scale(weight, block, clip)
    return codes(weight, scale, block), scale


def dequantize_int4(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    rows, columns = q.shape
    return (q.reshape(rows // block, block, columns).astype(np.float32) * scale[:, None, :]).reshape(rows, columns)


@dataclass(frozen=True)
class Int4Weight:
    """One MatMul's quantized weight: diag(input_scale)·W, quantized with `clip` per block and column."""

    input_scale: np.ndarray | None  # AWQ's t [K], shared by every MatMul reading the same activation
    clip: np.ndarray | None  # [K/B, N]
    block: int | None = None  # its block where the pass's does not divide K (layer_block); None: the pass's
    stored: GroupedInt4 | None = None  # a pre-quantized checkpoint's codes, taken as they are (nothing computed)


def int4_constant(name: str, q: np.ndarray) -> gs.Constant:
    """A packed INT4 initializer (onnx-graphsurgeon exports numpy's int4 only through an onnx TensorProto)."""
    import ml_dtypes
    from onnx import numpy_helper
    from onnx_graphsurgeon.ir.tensor import LazyValues

    return gs.Constant(name, LazyValues(numpy_helper.from_array(q.astype(ml_dtypes.int4), name)))


class Int4Details(PassDetails):
    block_size: int
    int4_weight_bytes: int
    skipped: dict[str, str]  # weight MatMul → why it stays float


@dataclass
class WeightOnlyInt4:
    """Quantize the MatMuls named in `weights` (constant 2-D weights with K a multiple of `block`). `floats`: the
    weight MatMuls the variant's plan keeps in float, with why; reported as skipped, so that the report counts
    what precision.json says rather than only the named weights it could not take."""

    weights: Mapping[str, Int4Weight]
    block: int = 128
    floats: Mapping[str, str] = field(default_factory=dict)
    name: str = "weight_only_int4"

    def __call__(self, graph: gs.Graph) -> PassReport:
        nodes = {node.name: node for node in graph.nodes if node.name in self.weights}
        scaled = self._apply_input_scales(graph, nodes)
        quantized, weight_bytes, skipped = 0, 0, dict(self.floats)
        indicators: dict[tuple[int, int], gs.Constant] = {}  # group sums' 0/1 matrices, one per (K/G, G)
        for name, node in nodes.items():
            weight = constant_value(node.inputs[1])
            plan = self.weights[name]
            block = plan.stored.group if plan.stored is not None else plan.block or self.block
            if weight is None or weight.ndim != 2 or weight.shape[0] % block:
                skipped[name] = f"weight {None if weight is None else list(weight.shape)}: not [K, N], K % {block}"
                continue
            stored = node.inputs[1]._values if isinstance(node.inputs[1], gs.Constant) else None
            weight = np.asarray(weight, dtype=np.float32)  # mapped, read for this layer only
            if plan.input_scale is not None:
                weight = weight * plan.input_scale[:, None]
            if plan.stored is not None:
                packed, scale = int4_constant(f"{name}/weight_int4", plan.stored.codes), plan.stored.scales
                if plan.stored.rows is not None:  # GPTQ's act-order: the input's features in the codes' row order
                    _read_input_in_order(graph, node, plan.stored.rows)
                offsets = plan.stored.zero_offsets()
                if offsets is not None:
                    _subtract_zero_offsets(graph, node, block, offsets, indicators)
            elif reads_rows(stored):  # codes made a block of rows at a time when written
                scale = int4_scale(weight, block, plan.clip)
                packed = gs.Constant(f"{name}/weight_int4", Int4Codes(stored, scale, block, plan.input_scale))
            else:
                q, scale = quantize_int4(weight, block, plan.clip)
                packed = int4_constant(f"{name}/weight_int4", q)
            del weight
            dequantized = gs.Variable(f"{name}/int4_weight", dtype=np.float32, shape=list(packed.shape))
            graph.nodes.append(
                gs.Node(
                    "DequantizeLinear",
                    name=f"{name}/DequantizeLinear",
                    attrs={"axis": 0, "block_size": block},
                    inputs=[
                        packed,
                        gs.Constant(f"{name}/weight_scale", scale),
                        int4_constant(f"{name}/weight_zero_point", np.zeros(scale.shape, np.int8)),
                    ],
                    outputs=[dequantized],
                )
            )
            node.inputs[1] = dequantized
            quantized += 1
            weight_bytes += int(np.prod(packed.shape)) // 2 + scale.nbytes
        return PassReport(
            self.name,
            changed=quantized > 0,
            counts={"matmuls_quantized": quantized, "activations_scaled": scaled, "skipped": len(skipped)},
            details=Int4Details(block_size=self.block, int4_weight_bytes=weight_bytes, skipped=skipped),
        )

    def _apply_input_scales(self, graph: gs.Graph, nodes: dict[str, gs.Node]) -> int:
        """x/t for every activation that has AWQ scales: folded into its normalization, else one shared Mul."""
        groups: dict[str, tuple[gs.Tensor, np.ndarray, list[gs.Node]]] = {}
        for name, node in nodes.items():
            scale = self.weights[name].input_scale
            if scale is not None:
                tensor = node.inputs[0]
                groups.setdefault(tensor.name, (tensor, scale, []))[2].append(node)
        for tensor, scale, readers in groups.values():
            inverse = (1.0 / scale).astype(np.float32)
            producer = tensor.inputs[0] if tensor.inputs else None
            only_readers = {id(user) for user in tensor.outputs} == {id(node) for node in readers}
            outputs = {id(output) for output in graph.outputs}
            if producer is not None and producer.op in NORMALIZATIONS and only_readers and id(tensor) not in outputs:
                for index in range(1, len(producer.inputs)):  # γ, and β where there is one
                    value = constant_value(producer.inputs[index])
                    if value is not None:
                        producer.inputs[index] = gs.Constant(f"{producer.name}/awq_{index}", value * inverse)
                continue
            (divided,) = graph.layer(
                op="Mul",
                name=f"{tensor.name}/AwqScale",
                inputs=[tensor, gs.Constant(f"{tensor.name}/awq_inverse_scale", inverse)],
                outputs=[f"{tensor.name}/awq_scaled"],
            )
            divided.dtype = np.float32
            for node in readers:
                node.inputs[0] = divided
        return len(groups)


def _read_input_in_order(graph: gs.Graph, node: gs.Node, rows: np.ndarray) -> None:
    """The MatMul reads its input's last axis in the order `rows` gives (x[..., rows] @ W[rows] = x @ W): one
    Gather of the activation, as ONNX Runtime's MatMulNBits does with GPTQ's g_idx."""
    (gathered,) = graph.layer(
        op="Gather",
        name=f"{node.name}/ActOrder",
        inputs=[node.inputs[0], gs.Constant(f"{node.name}/act_order", np.asarray(rows, np.int64))],
        outputs=[f"{node.name}/input_in_act_order"],
        attrs={"axis": -1},
    )
    gathered.dtype = node.inputs[0].dtype
    node.inputs[0] = gathered


def _subtract_zero_offsets(
    graph: gs.Graph, node: gs.Node, block: int, offsets: np.ndarray, indicators: dict[tuple[int, int], gs.Constant]
) -> None:
    """An asymmetric checkpoint's y = x·((q - z)·s) as x·(q·s) - (x summed per group)·(z·s): TensorRT takes INT4
    DequantizeLinear with zero points of 0 only ("Non-zero zero point is not supported", checked with tensorrt-rtx
    1.7), so the codes stay symmetric and the zero points become one small product (K/G rows) per layer. The sum
    per group is a product with a 0/1 matrix [K, K/G], rank-agnostic and shared by every layer of that K."""
    groups = offsets.shape[0]
    if (groups, block) not in indicators:
        indicator = np.repeat(np.eye(groups, dtype=np.float32), block, axis=0)
        indicators[groups, block] = gs.Constant(f"int4_group_sum_{groups * block}x{block}", indicator)
    indicator = indicators[groups, block]
    (output,) = node.outputs
    raw = gs.Variable(f"{node.name}/before_zero_points", dtype=output.dtype, shape=output.shape)
    node.outputs = [raw]
    (sums,) = graph.layer(
        op="MatMul",
        name=f"{node.name}/GroupSum",
        inputs=[node.inputs[0], indicator],
        outputs=[f"{node.name}/group_sums"],
    )
    (correction,) = graph.layer(
        op="MatMul",
        name=f"{node.name}/ZeroPoints",
        inputs=[sums, gs.Constant(f"{node.name}/zero_offsets", offsets)],
        outputs=[f"{node.name}/zero_correction"],
    )
    sums.dtype = correction.dtype = np.float32
    graph.layer(op="Sub", name=f"{node.name}/SubtractZeroPoints", inputs=[raw, correction], outputs=[output])


@dataclass
class GemmAsMatMul:
    """Gemm(A, B[, C]) with a constant 2-D weight → MatMul(A, B or Bᵀ) [+ C]: the form INT4 quantizes (and ONNX
    Runtime fuses into MatMulNBits); GPT-2's Conv1D layers export as Gemm. Only alpha = beta = 1 and no transA."""

    name: str = "gemm_as_matmul"

    def __call__(self, graph: gs.Graph) -> PassReport:
        rewritten = 0
        for node in [node for node in graph.nodes if node.op == "Gemm"]:
            weight = constant_value(node.inputs[1])
            attrs = node.attrs
            plain = float(attrs.get("alpha", 1.0)) == 1.0 and float(attrs.get("beta", 1.0)) == 1.0
            if weight is None or weight.ndim != 2 or int(attrs.get("transA", 0)) or not plain:
                continue
            if int(attrs.get("transB", 0)):
                weight = weight.T
            (output,) = node.outputs
            product = output if len(node.inputs) < 3 else f"{node.name}/product"
            node.outputs = []
            constant = gs.Constant(f"{node.name}/weight", np.ascontiguousarray(weight))
            (result,) = graph.layer(
                op="MatMul", name=f"{node.name}/MatMul", inputs=[node.inputs[0], constant], outputs=[product]
            )
            if len(node.inputs) == 3:
                result.dtype = output.dtype
                graph.layer(op="Add", name=f"{node.name}/Add", inputs=[result, node.inputs[2]], outputs=[output])
            rewritten += 1
        return PassReport(self.name, changed=rewritten > 0, counts={"gemms_rewritten": rewritten})
