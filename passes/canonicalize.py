"""Canonicalize: bring any graph to one form the later passes can rely on.

- the target ai.onnx opset (onnxscript's version converter), so fusions can emit LayerNormalization (17) and Gelu (20);
- constants folded, dead nodes removed, nodes in topological order, by onnxscript's optimizer on the onnx-ir
  model (it folds an exporter's Shape → Gather → Concat chains from the shapes it knows, in a fraction of the time
  Polygraphy's fold-and-infer loop takes: MiniLM's TorchScript export, 3.3 s → well under one); Constant nodes
  lifted to initializers. Where the optimizer fails on a graph, Polygraphy's `fold_constants` (onnx-graphsurgeon's
  folding with shape inference until nothing changes) does it, with the reason logged;
- shapes inferred on every tensor (onnx's shape inference, run without the weights' bytes).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
import onnx_ir as ir

from tensorsmith.core.checkpoint_references import holds_references
from tensorsmith.core.errors import PassError
from tensorsmith.core.file_layout import nearly_all_read
from tensorsmith.core.importing import first_line
from tensorsmith.core.ir import DEAD_AT_MOST, SUBGRAPH_ATTRIBUTES, save_ir
from tensorsmith.core.library_logs import route_polygraphy_logs
from tensorsmith.core.referring_ir import referred, referring_model, save_referring
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.runtime.manifest import external_data_path

logger = logging.getLogger(__name__)
FOLD_ANY_SIZE = 2**62
MADE_INSIDE_AT_MOST = 64 << 20  # bytes of folded constants the structure holds when canonicalize keeps the weights


def _opset(model: onnx.ModelProto) -> int:
    return next(int(e.version) for e in model.opset_import if e.domain in ("", "ai.onnx"))


def upgrade_opset(model: ir.Model, opset: int) -> None:
    """Convert `model` to `opset` in place if it is older (onnxscript's converter, onnx's where it has no
    adapter); a newer model is left as it is."""
    from onnxscript.version_converter import convert_version

    current = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
    if current >= opset:
        return
    unknown = sorted(
        {node.op_type for node in model.graph if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type)}
    )
    if unknown:  # onnxscript's converter passes them over; onnx's refused them
        raise PassError(
            f"cannot convert the model from opset {current} to {opset}: ai.onnx has no op {', '.join(unknown)}",
            hint=f"compile with --opset {current} to keep its opset",
        )
    try:
        convert_version(model, opset, fallback=True)
    except Exception as err:  # the converters raise RuntimeError, their C++ exceptions or their own
        raise PassError(
            f"cannot convert the model from opset {current} to {opset}: {first_line(err)}",
            hint=f"compile with --opset {current} to keep its opset",
        ) from err
    reached = model.opset_imports.get("", model.opset_imports.get("ai.onnx", current))
    if reached < opset:  # onnxscript's fallback logs a failed conversion and leaves the model as it was
        raise PassError(
            f"cannot convert the model from opset {current} to {opset}: the converter stopped at {reached}",
            hint=f"compile with --opset {current} to keep its opset",
        )


def _has_subgraphs(model: onnx.ModelProto) -> bool:
    return any(attribute.type in SUBGRAPH_ATTRIBUTES for node in model.graph.node for attribute in node.attribute)


def fold_with_onnxscript(model: ir.Model) -> ir.Model:
    """onnxscript's constant folding and shape-aware simplification (standard ops in, standard ops out), Constant
    nodes lifted to initializers, unused nodes dropped, shapes inferred."""
    from onnx_ir.passes.common import (
        LiftConstantsToInitializersPass,
        RemoveUnusedNodesPass,
        ShapeInferencePass,
        TopologicalSortPass,
    )
    from onnxscript.optimizer import fold_constants

    # no size limits: a tied output projection's Transpose of the embedding table folds into a weight, as
    # Polygraphy's loop folds it (onnxscript's defaults leave inputs over 8192 elements unfolded)
    fold_constants(model, input_size_limit=FOLD_ANY_SIZE, output_size_limit=FOLD_ANY_SIZE)
    for step in (
        LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        RemoveUnusedNodesPass(),
        TopologicalSortPass(),
        ShapeInferencePass(),
    ):
        step(model)
    return model


def fold_with_polygraphy(model: onnx.ModelProto) -> onnx.ModelProto:
    """Polygraphy's folding loop; a graph with control flow (If, Loop, Scan) is folded by onnx-graphsurgeon
    directly, without inlining branches (inlining nested Ifs leaves an invalid graph: silero-vad's, for one)."""
    from polygraphy.backend.onnx import fold_constants, infer_shapes

    route_polygraphy_logs()
    if _has_subgraphs(model):
        graph = gs.import_onnx(infer_shapes(model, error_ok=True, allow_onnxruntime=False))
        graph.fold_constants(fold_shapes=True, error_ok=True, flatten_subgraphs=False)
    else:
        # onnx's own shape inference, not ORT's symbolic one: deterministic, and it does not need sympy to agree.
        model = fold_constants(model, fold_shapes=True, error_ok=True, allow_onnxruntime_shape_inference=False)
        graph = gs.import_onnx(model)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return infer_shapes(gs.export_onnx(graph), error_ok=True, allow_onnxruntime=False)


def _release(model: ir.Model) -> None:
    """Drop the onnx-ir model's tensors (views of the input proto's bytes): onnxscript's module-level rewrite
    rules keep the last graph they matched, which would keep the input graph's weights alive."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            value.const_value = None


def _weights_kept(model: ir.Model, owned: Path, path: Path) -> onnx.ModelProto | None:
    """`model` saved at `path` over the weights file it reads, moved there from the directory `owned`, where every
    weight it holds is one of that file's or a small constant canonicalize folded (held in the structure, at most
    MADE_INSIDE_AT_MOST in all), and the file is nearly all read (core/ir.py's DEAD_AT_MOST); the structure written.
    None: the model has to be written whole."""
    files: set[Path] = set()
    read = made = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and graph is model.graph:
                files.add(Path(tensor.path).resolve())
                read += tensor.length if tensor.length is not None else tensor.nbytes
            elif isinstance(tensor, ir.ExternalTensor):
                return None  # a subgraph's weight: written whole
            elif tensor is not None:
                made += tensor.nbytes  # a constant canonicalize folded (a rotary table, say): inside the structure
    weights = nearly_all_read(files, read, DEAD_AT_MOST)
    if weights is None or made > MADE_INSIDE_AT_MOST or weights.parent != owned.resolve():
        return None
    sidecar = external_data_path(path)
    structure = ir.to_proto(model)
    for tensor in structure.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = sidecar.name
    os.replace(weights, sidecar)
    path.write_bytes(structure.SerializeToString())
    logger.debug("canonicalize: the export's %d bytes of weights kept; the structure written", read)
    return structure


class CanonicalizeDetails(PassDetails):
    opset_before: int
    opset_after: int
    folded_by: str  # the constant folder that ran: onnxscript, or polygraphy where it could not


@dataclass
class Canonicalize:
    """Upgrade the opset, fold constants, clean up, and infer shapes."""

    opset: int = 20
    name: str = "canonicalize"

    def __call__(self, model: onnx.ModelProto) -> tuple[onnx.ModelProto, PassReport]:
        """Works on the ModelProto, not a gs.Graph: opset conversion and shape inference are defined there."""
        return self._canonical(model, None)

    def to_file(
        self, model: onnx.ModelProto, path: Path, owned: Path | None = None
    ) -> tuple[onnx.ModelProto, PassReport]:
        """The canonical graph saved at `path` (core/ir.py's layout), and its structure without the weights: the
        weights are written from onnx-ir's views of `model`'s, never copied into a second protobuf. Where they
        all stay as they are in one file inside the directory `owned` (the export's), that file is moved into
        place and only the structure is written."""
        return self._canonical(model, path, owned)

    def _canonical(
        self, model: onnx.ModelProto, path: Path | None, owned: Path | None = None
    ) -> tuple[onnx.ModelProto, PassReport]:
        started = time.perf_counter()
        before = Counter(node.op_type for node in model.graph.node)
        opset_before = _opset(model)
        # one onnx-ir model for the conversion and the folding: one copy (weights kept in a checkpoint's files are
        # read only where a fold needs them: core/checkpoint_references.py)
        converted = referring_model(model, Path()) if holds_references(model) else ir.from_proto(model)
        upgrade_opset(converted, self.opset)
        folder = "onnxscript"
        try:
            folded: ir.Model | onnx.ModelProto = fold_with_onnxscript(converted)
        except Exception as err:  # the optimizer's own errors, of any type: Polygraphy's loop still folds
            logger.info("onnxscript's optimizer failed (%s): folding with Polygraphy", first_line(err)[:200])
            folder = "polygraphy"
            folded = fold_with_polygraphy(ir.to_proto(converted))
        if path is None:
            model = ir.to_proto(folded) if isinstance(folded, ir.Model) else folded
        elif isinstance(folded, ir.Model) and referred(folded):
            model = save_referring(folded, path)
        elif owned is not None and isinstance(folded, ir.Model) and (kept := _weights_kept(folded, owned, path)):
            model = kept
        else:
            save_ir(folded if isinstance(folded, ir.Model) else ir.from_proto(folded), path)
            model = onnx.load(str(path), load_external_data=False)
        _release(converted)
        after = Counter(node.op_type for node in model.graph.node)
        report = PassReport(
            name=self.name,
            changed=before != after or opset_before != _opset(model),
            counts={
                "nodes_before": sum(before.values()),
                "nodes_after": sum(after.values()),
                "constant_nodes_removed": before["Constant"] - after["Constant"],
            },
            seconds=round(time.perf_counter() - started, 4),
            details=CanonicalizeDetails(opset_before=opset_before, opset_after=_opset(model), folded_by=folder),
        )
        return model, report
