"""The pass framework: a pass rewrites an onnx-graphsurgeon graph in place and returns a `PassReport`.

`run_passes` times each pass, runs `cleanup().toposort()` after it (so a pass only re-wires tensors and never
deletes nodes by hand), and collects the reports that land in the manifest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import onnx_graphsurgeon as gs

logger = logging.getLogger(__name__)


@dataclass
class PassReport:
    """What one pass did: `counts` are integers (nodes folded, matches per rule…), `details` anything else."""

    name: str
    changed: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    details: dict[str, object] = field(default_factory=dict)


class GraphPass(Protocol):
    """A named callable that rewrites `graph` in place."""

    name: str

    def __call__(self, graph: gs.Graph) -> PassReport: ...


def run_passes(graph: gs.Graph, passes: Sequence[GraphPass]) -> list[PassReport]:
    reports = []
    for graph_pass in passes:
        started = time.perf_counter()
        report = graph_pass(graph)
        graph.cleanup().toposort()
        report.seconds = round(time.perf_counter() - started, 4)
        logger.info("pass %s: changed=%s %s (%.2f s)", report.name, report.changed, report.counts, report.seconds)
        reports.append(report)
    return reports
