"""Graph rewrites on onnx-graphsurgeon graphs, each returning a report that lands in the manifest."""

from tensorsmith.passes.base import GraphPass, PassReport, run_passes
from tensorsmith.passes.canonicalize import Canonicalize

__all__ = ["Canonicalize", "GraphPass", "PassReport", "run_passes"]
