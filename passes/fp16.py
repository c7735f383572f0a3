"""fp16 regions: the graph computes in fp16 (initializers stored in fp16, Casts at its float inputs and outputs),
except ops that must keep fp32, which get Casts around them. TensorRT's strongly typed networks take the
precision from these types, and FP16 LayerNorm overflows, so LayerNormalization stays fp32 by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import PassReport

FP16_MAX = float(np.finfo(np.float16).max)
KEEP_FP32 = ("LayerNormalization",)
FLOAT, HALF = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def _to_fp16(values: np.ndarray) -> np.ndarray:
    """fp32 values in fp16, clipped to its range first: an additive mask's finfo(float32).min must become
    -65504, not -inf (0 · -inf would be NaN)."""
    return np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)


def _is(tensor: gs.Tensor, dtype: type) -> bool:
    try:
        return tensor.dtype is not None and np.dtype(tensor.dtype) == dtype
    except TypeError:  # onnx-graphsurgeon gives ONNX enums, not numpy dtypes, for types numpy lacks (fp8)
        return False


def _is_fp32(tensor: gs.Tensor) -> bool:
    return _is(tensor, np.float32)


@dataclass
class ConvertToFp16:
    """Rewrite the graph to compute in fp16 with `keep_fp32` ops wrapped in Casts to and from fp32."""

    keep_fp32: Sequence[str] = KEEP_FP32
    name: str = "convert_to_fp16"

    def __call__(self, graph: gs.Graph) -> PassReport:
        kept = [node for node in graph.nodes if node.op in self.keep_fp32]
        kept_ids = {id(node) for node in kept}
        constants = 0
        # Constants: initializers and Constant nodes, except those read only by fp32 ops.
        for tensor in graph.tensors().values():
            if isinstance(tensor, gs.Constant) and _is_fp32(tensor):
                if tensor.outputs and all(id(user) in kept_ids for user in tensor.outputs):
                    continue
                tensor.values = _to_fp16(tensor.values)
                constants += 1
        for node in graph.nodes:
            value = node.attrs.get("value")
            if node.op in ("Constant", "ConstantOfShape") and isinstance(value, gs.Constant) and _is_fp32(value):
                node.attrs["value"] = gs.Constant(value.name, _to_fp16(value.values))
                constants += 1
            elif node.op == "Cast" and node.attrs.get("to") == FLOAT:
                node.attrs["to"] = HALF
        # Every float intermediate is now fp16 (types are re-inferred on export); graph I/O stays fp32 via Casts.
        for tensor in graph.tensors().values():
            if isinstance(tensor, gs.Variable) and _is_fp32(tensor):
                tensor.dtype = np.float16
        casts = 0
        for tensor in list(graph.inputs):
            if _is(tensor, np.float16):
                tensor.dtype = np.float32
                inside = gs.Variable(f"{tensor.name}/fp16", np.float16, tensor.shape)
                for user in list(tensor.outputs):
                    user.inputs[user.inputs.index(tensor)] = inside
                graph.nodes.append(gs.Node("Cast", f"{tensor.name}/Cast", {"to": HALF}, [tensor], [inside]))
                casts += 1
        for index, tensor in enumerate(list(graph.outputs)):
            if _is(tensor, np.float16):
                outside = gs.Variable(tensor.name, np.float32, tensor.shape)
                tensor.name = f"{tensor.name}/fp16"
                graph.nodes.append(gs.Node("Cast", f"{outside.name}/Cast", {"to": FLOAT}, [tensor], [outside]))
                graph.outputs[index] = outside
                casts += 1
        for node in kept:
            for position, tensor in enumerate(list(node.inputs)):
                if (
                    isinstance(tensor, gs.Variable)
                    and tensor.dtype is not None
                    and np.dtype(tensor.dtype) == np.float16
                ):
                    wide = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                    graph.nodes.append(gs.Node("Cast", f"{wide.name}/Cast", {"to": FLOAT}, [tensor], [wide]))
                    node.inputs[position] = wide
                    casts += 1
            for position, tensor in enumerate(list(node.outputs)):
                narrow_from = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                node.outputs[position] = narrow_from
                graph.nodes.append(gs.Node("Cast", f"{tensor.name}/Cast", {"to": HALF}, [narrow_from], [tensor]))
                casts += 1
        return PassReport(
            self.name,
            changed=True,
            counts={"constants_converted": constants, "casts_inserted": casts, "kept_fp32": len(kept)},
        )
