"""What a weight format does, and the graph form most formats share.

    W [K, N] ──quantize──► codes [K, N] (the record's element), scales [K/B, N] (a block of B rows of K and
    column) or [N] (a column) ──► DequantizeLinear(axis 0, block_size B | axis 1) ──► MatMul(x, ·)

A format is its precision record (what one code and one scale are, the block) and a `WeightFormat` subclass: the
numbers of quantizing and dequantizing, and the graph pass that writes a variant's layers in it; table.py lists
every format. The defaults here serve a format whose graph form is one DequantizeLinear (int8 weight-only, mxfp4,
a new blockwise format); INT4 (AWQ's scales, a checkpoint's codes and zero points), NVFP4 (two scale levels),
fp8-weight (a checkpoint's 2-D blocks) and the W8A8 levels (their activations' Q/DQ) write their own. A mixture of
experts' stacked weights take the same quantize, a slice at a time (stacked.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.elements import Element
from tensorsmith.core.precisions import Precision
from tensorsmith.passes.base import GraphPass, PassDetails, PassReport
from tensorsmith.passes.int4 import Int4Weight
from tensorsmith.passes.matching import constant_value


@dataclass(frozen=True)
class Quantized:
    """One [K, N] weight in a format: its codes (values the element holds exactly), scales [K/B, N] (a scale per
    block of B rows and column) or [N] (a scale per column), and a second-level scale per tensor where the format
    has one."""

    codes: np.ndarray
    scales: np.ndarray
    tensor_scale: float | None = None

    @property
    def block(self) -> int | None:
        """Rows of K a scale covers; None where a scale covers the whole column."""
        return None if self.scales.ndim == 1 else int(self.codes.shape[0] // self.scales.shape[0])

    def column_scales(self) -> np.ndarray:
        """The scale of every code [K, N] (blocks repeated along K), times the tensor scale."""
        scales = self.scales.astype(np.float32)
        if self.tensor_scale is not None:
            scales = scales * np.float32(self.tensor_scale)
        if self.block is None:
            return np.broadcast_to(scales, self.codes.shape)
        return np.repeat(scales, self.block, axis=0)

    def dequantized(self) -> np.ndarray:
        return (self.codes.astype(np.float32) * self.column_scales()).astype(np.float32)

    def one_level_scales(self) -> np.ndarray:
        """The scales as one DequantizeLinear takes them: float32 [K/B, N] ([N] for a scale per column), the
        tensor scale folded in (the product a second DequantizeLinear would compute, in float32: the same)."""
        scales = self.scales.astype(np.float32)
        if self.tensor_scale is not None:
            scales = scales * np.float32(self.tensor_scale)
        return scales


StoredCodes = Mapping[str, Callable[[np.ndarray], object]]  # MatMul → a checkpoint's own weight, from the graph's


@dataclass(frozen=True)
class LayerWeights:
    """What a variant asks of a format: its MatMuls with the plan's choice for each (AWQ's scales and clipping, a
    smaller block, a checkpoint's codes), the plan's block, the weight MatMuls kept in float (reported as skipped
    by the requested format's pass, so that the report counts what precision.json says), a checkpoint's own
    weights, the input scales of the formats that quantize activations, and whether the graph is the one ONNX
    Runtime measures (a format it cannot run writes the same values in float32 there)."""

    nodes: Mapping[str, Int4Weight]
    block: int
    floats: Mapping[str, str] = field(default_factory=dict)
    stored: StoredCodes = field(default_factory=dict)
    activation_scales: Mapping[str, float] = field(default_factory=dict)
    measured: bool = False


class WeightFormat:
    """A weight format: its record, and what quantizing in it means. Subclasses give `quantize` and, where their
    graph form is not one DequantizeLinear, `graph_pass`."""

    onnxruntime_runs = True  # ONNX Runtime's CPU provider runs its graph form; else measured on its values in fp32

    def __init__(self, record: Precision) -> None:
        self.record = record

    @property
    def reason(self) -> str:
        """What precision.json says of a layer stored in it."""
        return f"{self.record.name}: {self.record.description}"

    def block_for(self, rows: int, block: int | None = None) -> int | None:
        """The rows of K one scale covers in a weight of `rows` rows (`block`: the compile's, where the record's is
        configurable); None where the record's block does not divide them."""
        chosen = block if self.record.block_from_config and block else self.record.block
        if chosen is None:
            return rows
        return chosen if rows % chosen == 0 else None

    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        """`weight` [K, N] in this format, a scale per `block` rows of K and column (None: per column)."""
        raise NotImplementedError(f"{type(self).__name__} does not quantize")

    def dequantize(self, quantized: Quantized) -> np.ndarray:
        return quantized.dequantized()

    def computed(self, weight: np.ndarray, choice: Int4Weight | None = None, block: int | None = None) -> np.ndarray:
        """The weight a layer computes with in this format: quantized and read back, float32 [K, N]. `choice`: the
        plan's for the layer (INT4 applies AWQ's scales and clipping)."""
        return self.dequantize(self.quantize(weight, self.block_for(len(weight), block)))

    def graph_pass(self, layers: LayerWeights) -> GraphPass:
        """The pass that writes `layers` in this format."""
        return WeightOnly(self, layers)


class WeightOnlyDetails(PassDetails):
    precision: str
    block_sizes: list[int]  # rows of K a scale covers (K itself where a scale covers a column)
    weight_bytes: int  # codes and scales as stored
    skipped: dict[str, str]  # weight MatMul → why it stays float


@dataclass
class WeightOnly:
    """The MatMuls of `layers` read their weight through one DequantizeLinear of the format's codes (as the module's
    docstring draws it), or, in the graph ONNX Runtime measures where it cannot run the format, the same values in
    float32."""

    format: WeightFormat
    layers: LayerWeights
    name: str = ""  # weight_only_<precision>

    def __post_init__(self) -> None:
        self.name = self.name or f"weight_only_{self.format.record.name.replace('-', '_')}"

    def __call__(self, graph: gs.Graph) -> PassReport:
        quantized, weight_bytes, blocks = 0, 0, set()
        skipped = dict(self.layers.floats)
        for node in [node for node in graph.nodes if node.name in self.layers.nodes]:
            weight = constant_value(node.inputs[1])
            block = None if weight is None or weight.ndim != 2 else self._block(node.name, len(weight))
            if weight is None or weight.ndim != 2 or block is None:
                skipped[node.name] = f"weight {None if weight is None else list(weight.shape)}: not [K, N] in blocks"
                continue
            stored = self.layers.stored.get(node.name)
            values = np.asarray(weight, np.float32)
            made = stored(values) if stored is not None else self.format.quantize(values, block)
            assert isinstance(made, Quantized), f"{node.name}: a stored weight of {type(made).__name__}"
            node.inputs[1] = self._read(graph, node.name, made)
            quantized += 1
            weight_bytes += made.codes.size * self.format.record.element.bits // 8 + made.scales.size * 4
            blocks.add(made.block or len(made.codes))
        return PassReport(
            self.name,
            changed=quantized > 0,
            counts={"matmuls_quantized": quantized, "skipped": len(skipped)},
            details=WeightOnlyDetails(
                precision=self.format.record.name,
                block_sizes=sorted(blocks),
                weight_bytes=weight_bytes,
                skipped=skipped,
            ),
        )

    def _block(self, name: str, rows: int) -> int | None:
        chosen = self.layers.nodes[name].block or self.layers.block
        return self.format.block_for(rows, chosen)

    def _read(self, graph: gs.Graph, name: str, made: Quantized) -> gs.Tensor:
        if self.layers.measured and not self.format.onnxruntime_runs:
            return gs.Constant(f"{name}/weight_{self.format.record.name}_values", self.format.dequantize(made))
        element = self.format.record.element
        inputs = [stored_constant(f"{name}/weight_codes", made.codes, element)]
        inputs.append(gs.Constant(f"{name}/weight_scale", np.ascontiguousarray(made.one_level_scales())))
        if element.is_integer:  # TensorRT reads integer codes with an explicit zero point of 0
            inputs.append(stored_constant(f"{name}/weight_zero_point", np.zeros(made.scales.shape), element))
        attributes = {"axis": 1} if made.block is None else {"axis": 0, "block_size": made.block}
        (dequantized,) = graph.layer(
            op="DequantizeLinear",
            name=f"{name}/DequantizeLinear",
            attrs=attributes,
            inputs=inputs,
            outputs=[f"{name}/weight_dequantized"],
        )
        dequantized.dtype = np.float32
        return dequantized


def stored_constant(name: str, values: np.ndarray, element: Element) -> gs.Constant:
    """An initializer of `values` in the element's type: int8 and the float types as numpy holds them; int4, fp4
    and fp8, which numpy lacks, through an onnx TensorProto (onnx-graphsurgeon exports them only so)."""
    import ml_dtypes  # numpy has no int4, fp4 or fp8
    from onnx import numpy_helper
    from onnx_graphsurgeon.ir.tensor import LazyValues

    narrow = {Element.INT4: ml_dtypes.int4, Element.FP4_E2M1: ml_dtypes.float4_e2m1fn}
    typed = np.ascontiguousarray(values).astype(narrow.get(element, element.numpy_dtype()))
    if element in (Element.INT8, Element.FP16, Element.FP32):
        return gs.Constant(name, typed)
    return gs.Constant(name, LazyValues(numpy_helper.from_array(typed, name)))
