"""Canonicalize: bring any graph to one form the later passes can rely on.

- the target ai.onnx opset (onnx's version converter), so fusions can emit LayerNormalization (17) and Gelu (20);
- constants folded (Polygraphy's `fold_constants`, which runs onnx-graphsurgeon's folding with shape inference
  until nothing changes), dead nodes removed, nodes in topological order. A graph with control flow (If, Loop,
  Scan) is folded by onnx-graphsurgeon directly, without inlining branches: inlining nested Ifs (Polygraphy
  cannot switch it off) leaves an invalid graph (silero-vad's, for one);
- shapes inferred on every tensor (Polygraphy's `infer_shapes`, which handles models over 2 GB).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs
from onnx import version_converter

from tensorsmith.core.errors import PassError
from tensorsmith.core.ir import SUBGRAPH_ATTRIBUTES
from tensorsmith.passes.base import PassReport

logger = logging.getLogger(__name__)


def _quiet_polygraphy() -> None:
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR


def _opset(model: onnx.ModelProto) -> int:
    return next(int(e.version) for e in model.opset_import if e.domain in ("", "ai.onnx"))


def upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Convert `model` to `opset` if it is older; a newer model is left as it is."""
    current = _opset(model)
    if current >= opset:
        return model
    try:
        return version_converter.convert_version(model, opset)
    except Exception as err:  # the converter raises RuntimeError or its C++ exceptions
        raise PassError(
            f"cannot convert the model from opset {current} to {opset}: {str(err).splitlines()[0]}",
            hint=f"compile with --opset {current} to keep its opset",
        ) from err


def _has_subgraphs(model: onnx.ModelProto) -> bool:
    return any(attribute.type in SUBGRAPH_ATTRIBUTES for node in model.graph.node for attribute in node.attribute)


@dataclass
class Canonicalize:
    """Upgrade the opset, fold constants, clean up, and infer shapes."""

    opset: int = 20
    name: str = "canonicalize"

    def __call__(self, model: onnx.ModelProto) -> tuple[onnx.ModelProto, PassReport]:
        """Works on the ModelProto, not a gs.Graph: opset conversion and shape inference are defined there."""
        from polygraphy.backend.onnx import fold_constants, infer_shapes

        _quiet_polygraphy()
        started = time.perf_counter()
        before = Counter(node.op_type for node in model.graph.node)
        opset_before = _opset(model)
        model = upgrade_opset(model, self.opset)
        if _has_subgraphs(model):
            graph = gs.import_onnx(infer_shapes(model, error_ok=True, allow_onnxruntime=False))
            graph.fold_constants(fold_shapes=True, error_ok=True, flatten_subgraphs=False)
        else:
            # onnx's own shape inference, not ORT's symbolic one: deterministic, and it does not need sympy to agree.
            model = fold_constants(model, fold_shapes=True, error_ok=True, allow_onnxruntime_shape_inference=False)
            graph = gs.import_onnx(model)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        model = infer_shapes(gs.export_onnx(graph), error_ok=True, allow_onnxruntime=False)
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
            details={"opset_before": opset_before, "opset_after": _opset(model)},
        )
        return model, report
