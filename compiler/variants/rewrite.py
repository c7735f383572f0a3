"""Write a variant file: passes run on a copy of a graph, the result saved (node module paths kept)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from tensorsmith.compiler.targets import Recipe
from tensorsmith.core.ir import save_onnx
from tensorsmith.core.mapped_graph import mapped
from tensorsmith.core.mapped_save import save_mapped
from tensorsmith.core.module_paths import attach_module_paths, module_paths_recorded
from tensorsmith.passes import GraphPass, PassReport, run_passes
from tensorsmith.passes.embeddings import QuantizeEmbeddings
from tensorsmith.passes.fp16 import ConvertToFp16
from tensorsmith.passes.quantize import InsertQDQ, Precision

VARIANTS_DIR = "variants"


def variant_path(directory: Path, name: str) -> Path:
    return directory / VARIANTS_DIR / f"{name}.onnx"


def _run(model: onnx.ModelProto, passes: list[GraphPass]) -> tuple[onnx.ModelProto, list[PassReport]]:
    graph = gs.import_onnx(model)
    reports = run_passes(graph, passes)
    return gs.export_onnx(graph), reports


def rewritten(model: onnx.ModelProto, passes: list[GraphPass]) -> tuple[onnx.ModelProto, list[PassReport]]:
    """`model` after `passes`, in memory, with the module paths its nodes carried (onnx-graphsurgeon drops node
    metadata): a graph that later variants start from."""
    result, reports = _run(model, passes)
    attach_module_paths(result, module_paths_recorded(model))
    return result, reports


def rewrite(model: onnx.ModelProto, passes: list[GraphPass], path: Path) -> list[PassReport]:
    """Run `passes` on a copy of `model` and save the result at `path`: a variant file. Variant files carry no
    module paths (precision.json names each layer's module), so their bytes depend on the graph alone."""
    result, reports = _run(model, passes)
    path.parent.mkdir(exist_ok=True)
    save_onnx(result, path)
    return reports


def rewrite_file(source: Path, passes: list[GraphPass], path: Path) -> list[PassReport]:
    """Run `passes` on the graph saved at `source`, its weights memory-mapped (core/mapped_graph.py), and save the
    result at `path` (which may be `source`): no weight is copied that no pass changes."""
    with mapped(source) as (graph, _):
        reports = run_passes(graph, passes)
        save_mapped(graph, path)
    return reports


def write_quantized(
    model: onnx.ModelProto,
    precision: Precision,
    scales: dict[str, float],
    nodes: list[str],
    recipe: Recipe,
    path: Path,
    embeddings: bool = False,
) -> PassReport:
    """Q/DQ on `nodes`; with `embeddings`, vocabulary tables stored in int8 (weight-only); with fp16 floats,
    everything left in float computes in fp16 (LayerNorm in fp32)."""
    passes: list[GraphPass] = [InsertQDQ(precision, scales, nodes=nodes)]
    if embeddings:
        passes.append(QuantizeEmbeddings(gather_first=recipe.on_cpu))  # the cpu's backends gather int8 rows first
    if recipe.fp16_regions:
        passes.append(ConvertToFp16())
    return rewrite(model, passes, path)[0]
