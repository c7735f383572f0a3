"""A decoder's KV cache in FLOAT8E4M3FN: each layer's keys and values quantized with one per-tensor scale.

The engine graph (after passes/static_cache.py), the cache itself in fp8:

    new ─► QuantizeLinear(scale) ─┐
    past (fp8) ───────────────────┼► TensorScatter ─► present (fp8) ─► DequantizeLinear(scale) ─► Attention
    write_indices ────────────────┘

The measured graph (the dynamic cache, for perplexity on ONNX Runtime's CPU provider): the rounding simulated on
the new entries before their Concat, the cache's dtype unchanged,

    new ─► QuantizeLinear(scale) ─► DequantizeLinear(scale) ─► Concat(past, ·) ─► present

`scales` maps a present's name (`present.{layer}.{key|value}`) to its scale, amax / 448 on the fp32 graph
(`fp8_scale`): a value past the scale's range saturates to ±448 (QuantizeLinear's default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core.errors import PassError
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.cache_graph import GraphDtype

FP8_MAX = 448.0  # FLOAT8E4M3FN's largest finite value
FP8 = onnx.TensorProto.FLOAT8E4M3FN


def fp8_scale(amax: float) -> float:
    """The per-tensor scale that maps [-amax, amax] onto FLOAT8E4M3FN's range (1 for an all-zero tensor)."""
    return float(amax) / FP8_MAX if amax > 0 else 1.0


class QuantizedCacheDetails(PassDetails):
    simulated: bool  # fp32 caches rounded through fp8, not stored in it
    scale_min: float
    scale_max: float
    cache_dtype: str


@dataclass
class QuantizedCache:
    """The static graph's caches in fp8 (`simulate=False`), or the dynamic graph's rounding simulated in place."""

    scales: Mapping[str, float]
    simulate: bool = False
    name: str = "fp8_kv_cache"

    def __call__(self, graph: gs.Graph) -> PassReport:
        outputs = {tensor.name: tensor for tensor in graph.outputs}
        missing = [name for name in self.scales if name not in outputs]
        if missing:
            raise PassError(f"the graph has no {missing[0]} output", hint="a decoder's KV-cache graph")
        for name, scale in self.scales.items():
            present = outputs[name]
            if self.simulate:
                self._simulate(graph, present, scale)
            else:
                self._quantize(graph, present, scale)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        values = list(self.scales.values())
        return PassReport(
            self.name,
            changed=True,
            counts={"caches": len(values)},
            details=QuantizedCacheDetails(
                simulated=self.simulate,
                scale_min=min(values),
                scale_max=max(values),
                cache_dtype="float8e4m3fn" if not self.simulate else "unchanged",
            ),
        )

    def _quantize(self, graph: gs.Graph, present: gs.Variable, scale: float) -> None:
        scatter = present.inputs[0] if present.inputs else None
        if scatter is None or scatter.op != "TensorScatter":
            raise PassError(f"{present.name} is not written by TensorScatter", hint="the static KV cache first")
        past, new = scatter.inputs[0], scatter.inputs[1]
        readers = list(present.outputs)
        scale_tensor, zero = _scale(present.name, scale, new.dtype), _zero(present.name)
        quantized = gs.Variable(f"{present.name}/fp8_new", FP8, new.shape)
        graph.nodes.append(
            gs.Node("QuantizeLinear", f"{present.name}/QuantizeLinear", {}, [new, scale_tensor, zero], [quantized])
        )
        scatter.inputs[1] = quantized
        past.dtype = present.dtype = FP8
        dequantized = gs.Variable(f"{present.name}/dequantized", new.dtype, present.shape)
        graph.nodes.append(
            gs.Node(
                "DequantizeLinear", f"{present.name}/DequantizeLinear", {}, [present, scale_tensor, zero], [dequantized]
            )
        )
        for node in readers:
            for index, tensor in enumerate(node.inputs):
                if tensor is present:
                    node.inputs[index] = dequantized

    def _simulate(self, graph: gs.Graph, present: gs.Variable, scale: float) -> None:
        concat = present.inputs[0] if present.inputs else None
        if concat is not None and concat.op == "Cast" and concat.inputs[0].inputs:  # an fp16 variant's fp32 ends
            concat = concat.inputs[0].inputs[0]
        if concat is None or concat.op != "Concat" or len(concat.inputs) != 2:
            raise PassError(f"{present.name} is not Concat(past, new)", hint="a dynamic KV cache")
        new = concat.inputs[1]
        scale_tensor, zero = _scale(present.name, scale, new.dtype), _zero(present.name)
        quantized = gs.Variable(f"{present.name}/fp8_new", FP8, new.shape)
        rounded = gs.Variable(f"{present.name}/fp8_rounded", new.dtype, new.shape)
        graph.nodes.append(
            gs.Node("QuantizeLinear", f"{present.name}/QuantizeLinear", {}, [new, scale_tensor, zero], [quantized])
        )
        graph.nodes.append(
            gs.Node(
                "DequantizeLinear", f"{present.name}/DequantizeLinear", {}, [quantized, scale_tensor, zero], [rounded]
            )
        )
        concat.inputs[1] = rounded


def _scale(name: str, scale: float, dtype: GraphDtype) -> gs.Constant:
    """The scale in the quantized tensor's dtype (QuantizeLinear's x and y_scale share one)."""
    if isinstance(dtype, int):  # bfloat16: numpy has none; onnx's helper writes it from float32
        proto = onnx.helper.make_tensor(f"{name}/fp8_scale", dtype, [], [scale])
        return gs.Constant(proto.name, gs.ir.tensor.LazyValues(proto))
    return gs.Constant(f"{name}/fp8_scale", np.array(scale, np.dtype(dtype)))


def _zero(name: str) -> gs.Constant:
    """An fp8 zero point: it gives QuantizeLinear its output type (numpy has no fp8; the proto carries it)."""
    proto = onnx.helper.make_tensor(f"{name}/fp8_zero", FP8, [], [0.0])
    return gs.Constant(proto.name, gs.ir.tensor.LazyValues(proto))
