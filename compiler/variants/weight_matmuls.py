"""The weight MatMuls of a graph (a constant 2-D float weight) and which of them a blockwise format can take: what
every weight-only plan starts from."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.compiler.variants.precision_plan import LayerChoice
from tensorsmith.core.mapped_graph import load_mapped, values_unkept, weights_released
from tensorsmith.core.module_paths import module_paths_recorded
from tensorsmith.passes.int4 import SMALLER_BLOCKS, layer_block
from tensorsmith.passes.matching import constant_value


@dataclass(frozen=True)
class WeightLayer:
    """One weight MatMul of the graph, as the plans and precision.json name it."""

    module: str  # the source module's path ("" where the graph records none)
    activation: str  # the input tensor it multiplies
    elements: int  # of its weight (K x N): its FLOPs per token, and its size

    def choice(self, name: str, precision: str, reason: str, sensitivity: float | None = None) -> LayerChoice:
        """Its row in precision.json."""
        return LayerChoice(
            name=name,
            module=self.module,
            op="MatMul",
            inputs=[self.activation],
            flops=self.elements,
            precision=precision,
            sensitivity=sensitivity,
            reason=reason,
        )


@dataclass(frozen=True)
class Pin:
    """A weight layer's level fixed by an `[[overrides]]` entry: the search never moves it."""

    level: str
    reason: str  # the override that pins it, as precision.json says


@dataclass(frozen=True)
class WeightMatMuls:
    chosen: dict[str, tuple[str, gs.Constant]]  # node → (input activation, weight [K, N]: read with weight_array)
    skipped: dict[str, str]  # node → why it stays in float
    layers: dict[str, WeightLayer]  # every weight MatMul
    blocks: dict[str, int] = field(default_factory=dict)  # chosen node → its block where smaller than asked


GraphSource = onnx.ModelProto | Path  # a graph in memory, or saved (its weights then memory-mapped when read)


@contextlib.contextmanager
def source_graph(source: GraphSource) -> Iterator[tuple[gs.Graph, onnx.ModelProto]]:
    """onnx-graphsurgeon's graph of `source` and the proto whose node metadata (module paths) it was read from,
    the values read from it let go after the block (mapped_graph.weights_released)."""
    graph, structure = load_mapped(source) if isinstance(source, Path) else (gs.import_onnx(source), source)
    with weights_released(graph):
        yield graph, structure


def weight_array(weight: gs.Constant) -> np.ndarray:
    """A weight's values in fp32, read for this use only: a memory-mapped weight is not kept loaded by its graph
    (every weight of a 1B model held at once would be its size again in memory)."""
    return np.asarray(values_unkept(weight), dtype=np.float32)


def weight_matmuls(source: GraphSource, block: int) -> WeightMatMuls:
    """The MatMuls with a constant 2-D float weight, and which of them INT4 can take (in `block`, or the largest
    smaller block that divides their K)."""
    with source_graph(source) as (graph, structure):
        return _weight_matmuls(graph, module_paths_recorded(structure), block)  # module paths: frontend/fused.py


def _weight_matmuls(graph: gs.Graph, modules: dict[str, str], block: int) -> WeightMatMuls:
    chosen, skipped, layers, blocks = {}, {}, {}, {}
    for node in graph.nodes:
        if node.op != "MatMul" or constant_value(node.inputs[0]) is not None:
            continue
        weight = node.inputs[1]
        if not isinstance(weight, gs.Constant) or len(weight.shape) != 2 or not _is_float(weight.dtype):
            continue
        rows, columns = (int(dim) for dim in weight.shape)
        layers[node.name] = WeightLayer(modules.get(node.name, ""), node.inputs[0].name, rows * columns)
        fits = layer_block(rows, block)
        if fits is None:
            smallest = min(block, *SMALLER_BLOCKS)
            skipped[node.name] = f"input dim {rows} is not a multiple of {smallest} (the smallest block)"
            continue
        chosen[node.name] = (node.inputs[0].name, weight)
        if fits != block:
            blocks[node.name] = fits
    return WeightMatMuls(chosen, skipped, layers, blocks)


def _is_float(dtype: object) -> bool:
    """numpy's float kinds; onnx-graphsurgeon gives a type numpy has none of (bf16) as ONNX's enum."""
    try:
        return np.dtype(dtype).kind == "f"  # type: ignore[call-overload]
    except TypeError:
        return False
