"""Insert Q/DQ for TensorRT's explicit quantization, from a precision plan and activation scales.

    x ──► QuantizeLinear(s_x, 0) ──► DequantizeLinear(s_x, 0) ──┐
    W (int8 / fp8 initializer) ──► DequantizeLinear(s_W[c], 0, axis) ──┴─► MatMul / Gemm / Conv ──► (float)

- activations: per-tensor, symmetric (zero point 0); one Q/DQ pair per tensor, shared by its quantized
  consumers; both inputs of an activation × activation MatMul (attention's Q·Kᵀ, P·V);
- weights: per-channel on the output-channel axis (MatMul B [K, N]: axis 1; Gemm: 0 with transB, else 1;
  Conv: 0), stored quantized as initializers, so the variant file shrinks;
- no Q/DQ on outputs, biases stay float (TensorRT folds them), and everything else stays in float.
Only standard ONNX ops; fp8 (float8e4m3fn) needs opset 19.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core import precisions
from tensorsmith.core.errors import PassError
from tensorsmith.core.formats import per_channel_amax
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.matching import constant_value

logger = logging.getLogger(__name__)

Precision = str  # the name of a calibrated precision of the table: int8 or fp8
QUANTIZABLE_OPS = ("MatMul", "Gemm", "Conv")
FLOAT_TYPES = (np.float32, np.float16)
# float32 bytes of weights scaled and rounded at a time: a block stays in the cache across its three passes
QUANTIZED_BLOCK_BYTES = 1 << 20


def quantizable_nodes(graph: gs.Graph) -> list[gs.Node]:
    return [node for node in graph.nodes if node.op in QUANTIZABLE_OPS]


def weight_axis(node: gs.Node, weight: np.ndarray) -> int:
    """The output-channel axis of a weight input (REFERENCE.md §4)."""
    if node.op == "Conv":
        return 0
    if node.op == "Gemm":
        return 0 if int(node.attrs.get("transB", 0)) else 1
    return weight.ndim - 1  # MatMul B [..., K, N]


def activation_inputs(node: gs.Node) -> list[gs.Tensor]:
    """The float, non-constant inputs of a quantizable node that get per-tensor Q/DQ (never a bias)."""
    candidates = node.inputs[:2]
    return [
        tensor
        for tensor in candidates
        if constant_value(tensor) is None and (tensor.dtype is None or np.dtype(tensor.dtype) in FLOAT_TYPES)
    ]


def quantize_weights(weights: np.ndarray, axis: int, precision: Precision) -> tuple[np.ndarray, np.ndarray]:
    """(quantized weights, per-channel scales) in the element of `precision` (its record says): int8 rounded into
    [-127, 127], or float8e4m3fn saturating at ±448. Scaled, rounded and clipped a block of rows at a time, in the
    cache: whole, a vocabulary table (Llama-3.2-1B's, 1 GB of fp32) took 5.4 s in four passes over fresh memory."""
    element = precisions.precision(precision).element
    limit = element.maximum
    weights = np.asarray(weights, dtype=np.float32)  # no copy of fp32 weights
    amax = per_channel_amax(weights, axis)
    scales = np.where(amax > 0, amax / limit, 1.0).astype(np.float32)  # an all-zero channel: any positive scale
    shape = [1] * weights.ndim
    shape[axis % weights.ndim] = -1
    divisors = scales.reshape(shape)
    per_row = len(divisors) > 1  # a scale per row (axis 0): a block of rows takes its own
    codes = np.empty(weights.shape, element.numpy_dtype())
    rows = max(1, QUANTIZED_BLOCK_BYTES // max(1, 4 * int(np.prod(weights.shape[1:], dtype=np.int64))))
    for start in range(0, max(1, len(weights)), rows):
        block = weights[start : start + rows] / (divisors[start : start + rows] if per_row else divisors)
        if element.is_integer:
            np.rint(block, out=block)
        codes[start : start + rows] = np.clip(block, -limit, limit, out=block)
    return codes, scales


def _zero(precision: Precision, shape: tuple[int, ...] = ()) -> np.ndarray:
    return np.zeros(shape, dtype=precisions.precision(precision).element.numpy_dtype())


def quantize_activation(
    graph: gs.Graph, tensor: gs.Tensor, scale: float, precision: Precision, name: str | None = None
) -> gs.Variable:
    """DequantizeLinear(QuantizeLinear(tensor)) with a per-tensor `scale` and zero point 0: the activation side
    (nodes named after `name`, the tensor's name by default)."""
    name = name or tensor.name
    scale_constant = gs.Constant(f"{name}/scale", np.array(scale, np.float32))
    zero = gs.Constant(f"{name}/zero_point", _zero(precision))
    (quantized,) = graph.layer(
        op="QuantizeLinear",
        name=f"{name}/QuantizeLinear",
        inputs=[tensor, scale_constant, zero],
        outputs=[f"{name}/quantized"],
    )
    (dequantized,) = graph.layer(
        op="DequantizeLinear",
        name=f"{name}/DequantizeLinear",
        inputs=[quantized, scale_constant, zero],
        outputs=[f"{name}/dequantized"],
    )
    dequantized.dtype = np.float32
    return dequantized


SWITCHES = "quantization_switches"


class QdqDetails(PassDetails):
    precision: str
    skipped: dict[str, str]  # node → why it got no Q/DQ


@dataclass
class InsertQDQ:
    """Quantize the inputs of `nodes` (names; None: every MatMul/Gemm/Conv) to `precision` with the given
    per-tensor activation scales. A node whose activation has no scale stays in float, with the reason.

    `switched=True` builds the graph the precision search evaluates: each input of node k becomes an If on s[k]
    (`switched`), QDQ(x) where it is 1, x where it is 0, with `s` a new graph input (SWITCHES, one float per node,
    in the order of `nodes`), so a single ONNX Runtime session evaluates any subset of quantized nodes by feeding
    0s and 1s, running only the Q/DQ of the nodes switched on."""

    precision: Precision
    activation_scales: Mapping[str, float]
    nodes: Collection[str] | None = None
    switched: bool = False
    suffix: str = ""  # appended to the activation Q/DQ's names (two precisions in one graph)
    name: str = "insert_qdq"

    def __call__(self, graph: gs.Graph) -> PassReport:
        needs = precisions.precision(self.precision).min_opset
        if graph.opset < needs:
            raise PassError(
                f"{self.precision} Q/DQ needs opset {needs}, the graph has {graph.opset}",
                hint=f"compile with --opset {needs} or newer",
            )
        dequantized: dict[str, gs.Variable] = {}
        activations_quantized: set[str] = set()
        skipped: dict[str, str] = {}
        quantized_nodes = quantized_weights = 0
        switch_index = {name: index for index, name in enumerate(self.nodes or [])}
        switches = None
        if self.switched:
            switches = gs.Variable(SWITCHES, np.float32, [len(switch_index)])
            graph.inputs.append(switches)
        for node in quantizable_nodes(graph):
            if self.nodes is not None and node.name not in self.nodes:
                continue
            activations = activation_inputs(node)
            missing = [t.name for t in activations if t.name not in self.activation_scales]
            if missing:
                skipped[node.name] = f"no calibrated scale for {missing}"
                continue
            switch = self._switch(graph, switches, switch_index[node.name]) if switches is not None else None
            for tensor in activations:
                scale, named = self.activation_scales[tensor.name], tensor.name + self.suffix
                if switch is not None:  # this node's own Q/DQ, run only where its switch is on
                    own = f"{named}/{node.name}"
                    quantize = functools.partial(
                        quantize_activation, tensor=tensor, scale=scale, precision=self.precision, name=own
                    )
                    replacement = switched(graph, tensor, switch, own, quantize)
                else:  # one Q/DQ per activation, shared by the nodes that read it
                    if tensor.name not in dequantized:
                        dequantized[tensor.name] = quantize_activation(graph, tensor, scale, self.precision, named)
                    replacement = dequantized[tensor.name]
                activations_quantized.add(tensor.name)
                node.inputs[node.inputs.index(tensor)] = replacement
            weight_index = 1
            weight = constant_value(node.inputs[weight_index]) if len(node.inputs) > 1 else None
            if weight is not None and weight.dtype in FLOAT_TYPES and weight.ndim >= 2:
                original = node.inputs[weight_index]
                if switch is not None:
                    quantize = functools.partial(self._quantize_weight, node=node, weight=weight)
                    replacement = switched(graph, original, switch, f"{node.name}/weight", quantize)
                else:
                    replacement = self._quantize_weight(graph, node, weight)
                node.inputs[weight_index] = replacement
                quantized_weights += 1
            quantized_nodes += 1
        for node_name, reason in skipped.items():
            logger.info("left %s in float: %s", node_name, reason)
        return PassReport(
            self.name,
            changed=quantized_nodes > 0,
            counts={
                "nodes_quantized": quantized_nodes,
                "activations_quantized": len(activations_quantized),
                "weights_quantized": quantized_weights,
                "nodes_skipped": len(skipped),
            },
            details=QdqDetails(precision=self.precision, skipped=skipped),
        )

    @staticmethod
    def _switch(graph: gs.Graph, switches: gs.Variable, index: int) -> gs.Variable:
        (switch,) = graph.layer(
            op="Gather",
            name=f"{SWITCHES}/{index}",
            inputs=[switches, gs.Constant(f"{SWITCHES}/index_{index}", np.array(index, np.int64))],
            outputs=[f"{SWITCHES}/switch_{index}"],
        )
        switch.dtype = np.float32
        return switch

    def _quantize_weight(self, graph: gs.Graph, node: gs.Node, weight: np.ndarray) -> gs.Variable:
        axis = weight_axis(node, weight)
        values, scales = quantize_weights(weight, axis, self.precision)
        prefix = f"{node.name}/weight"
        (dequantized,) = graph.layer(
            op="DequantizeLinear",
            name=f"{prefix}/DequantizeLinear",
            attrs={"axis": axis},
            inputs=[
                gs.Constant(f"{prefix}/quantized", values),
                gs.Constant(f"{prefix}/scale", scales),
                gs.Constant(f"{prefix}/zero_point", _zero(self.precision, scales.shape)),
            ],
            outputs=[f"{prefix}/dequantized"],
        )
        dequantized.dtype = weight.dtype
        return dequantized


def switched(
    graph: gs.Graph, original: gs.Tensor, switch: gs.Tensor, name: str, quantize: Callable[[gs.Graph], gs.Variable]
) -> gs.Variable:
    """`quantize`'s value (its nodes built into the branch it is given) where `switch` is non-zero, `original`
    where it is 0: an If, whose quantizing branch ONNX Runtime runs only when taken. Blending every node's quantized
    value with its float one computed all of them in every run of a search, one switch on or all: on MiniLM a
    sensitivity run took 0.20 s (int8) and 0.33 s (fp8) against about 0.08 for the float graph."""
    quantizing = gs.Graph(opset=graph.opset, name=f"{name}/quantized_branch")
    value = quantize(quantizing)
    quantizing.outputs = [value]
    keeping = gs.Graph(opset=graph.opset, name=f"{name}/float_branch")
    (same,) = keeping.layer(op="Identity", name=f"{name}/float", inputs=[original], outputs=[f"{name}/float"])
    same.dtype = value.dtype
    keeping.outputs = [same]
    (on,) = graph.layer(
        op="Cast", name=f"{name}/on", inputs=[switch], outputs=[f"{name}/on"], attrs={"to": onnx.TensorProto.BOOL}
    )
    (chosen,) = graph.layer(
        op="If",
        name=f"{name}/switched",
        inputs=[on],
        outputs=[f"{name}/switched"],
        attrs={"then_branch": quantizing, "else_branch": keeping},
    )
    chosen.dtype = value.dtype
    return chosen
