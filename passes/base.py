"""The pass framework: a pass rewrites an onnx-graphsurgeon graph in place and returns a `PassReport`.

`run_passes` times each pass, runs `cleanup().toposort()` after it (so a pass only re-wires tensors and never
deletes nodes by hand), checks that it left each tensor name once, and collects the reports that land in the
manifest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self

import onnx_graphsurgeon as gs
from pydantic import BaseModel, ConfigDict, ValidationError

from tensorsmith.core.errors import PassError
from tensorsmith.core.library_logs import route_graphsurgeon_logs

logger = logging.getLogger(__name__)
# Every module that rewrites graphs imports this one: from here on, onnx-graphsurgeon logs, it does not print.
route_graphsurgeon_logs()


class PassDetails(BaseModel):
    """What a pass found beyond its counts; each pass that has any subclasses this with its own fields, which the
    manifest stores as its JSON (fields at their default left out) and the summary reads back typed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def as_json(self) -> dict[str, object]:
        return self.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def read(cls, stored: Mapping[str, object]) -> Self | None:
        """A manifest's details (`as_json`) read back as this pass's; None where they are another pass's."""
        try:
            return cls.model_validate(stored)
        except ValidationError:
            return None


class SkippedDetails(PassDetails):
    reason: str  # why the pass did not run


@dataclass
class PassReport:
    """What one pass did: `counts` are integers (nodes folded, matches per rule…), `details` the rest, typed."""

    name: str
    changed: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    details: PassDetails = field(default_factory=PassDetails)
    variant: str = ""  # set by the variant builders: the variant whose file the pass wrote


class GraphPass(Protocol):
    """A named callable that rewrites `graph` in place."""

    name: str

    def __call__(self, graph: gs.Graph) -> PassReport: ...


def unused_name(graph: gs.Graph, name: str) -> str:
    """`name`, or `name_2`, `name_3`…: the first that no tensor of `graph` has. For a tensor a pass makes from one
    that several nodes share (an exporter stores equal weights once), where each reader gets its own."""
    taken = graph.tensors().keys()
    candidate, number = name, 1
    while candidate in taken:
        number += 1
        candidate = f"{name}_{number}"
    return candidate


def check_unique_names(graph: gs.Graph, name: str) -> None:
    """Each tensor name once: ONNX joins tensors by name, so two of one name export as a graph that ONNX Runtime
    refuses (out of order, types that disagree) or that reads the wrong weights."""
    seen: dict[str, gs.Tensor] = {}
    for node in graph.nodes:
        for tensor in [*node.inputs, *node.outputs]:
            if not tensor.is_empty() and seen.setdefault(tensor.name, tensor) is not tensor:
                raise PassError(
                    f"pass {name} left two tensors named '{tensor.name}'",
                    hint="a tensorsmith bug: please report it with the model",
                )


def run_passes(graph: gs.Graph, passes: Sequence[GraphPass]) -> list[PassReport]:
    reports = []
    for graph_pass in passes:
        started = time.perf_counter()
        report = graph_pass(graph)
        graph.cleanup().toposort()
        check_unique_names(graph, report.name)
        report.seconds = round(time.perf_counter() - started, 4)
        logger.info("pass %s: changed=%s %s (%.2f s)", report.name, report.changed, report.counts, report.seconds)
        reports.append(report)
    return reports
