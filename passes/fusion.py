"""The fusion pass: apply rules, each anchored on one op, and report matches and misses per rule.

A rule is data (STYLE.md §3): a name, an anchor op, an ASCII sketch of what it matches, the opset its
replacement needs, and a `match` function that walks from the anchor and returns the replacement nodes or
raises `Miss`. The pass does the rest the same way for every rule: skip anchors already fused, apply the shared
`check_removable`, splice the replacement in (disconnect, insert; `cleanup()` removes what is dead).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs
from pydantic import Field
from typing_extensions import TypedDict

from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.matching import Miss, Unrelated, Walk, check_removable

logger = logging.getLogger(__name__)

MISSES_KEPT_PER_RULE = 20  # in the report's details; the counts cover all of them


class FusionMiss(TypedDict):  # typing_extensions': pydantic reads it on Python 3.11
    node: str  # the anchor the rule started from
    reason: str


class FusionDetails(PassDetails):
    misses: dict[str, list[FusionMiss]]  # rule → the first anchors it missed
    reasons: dict[str, dict[str, int]]  # rule → each reason it missed for, how often
    needs_opset: dict[str, int] = Field(default_factory=dict)  # rule → the opset it needs, for rules not tried below it


PREVIOUS = None  # as a NodeSpec input: the output of the spec before it

# What a rule's match returns: the rewrite to apply, run only after the pass has checked the match is safe.
Rewrite = Callable[[], None]


@dataclass(frozen=True)
class Rule:
    name: str
    anchor: str
    sketch: str
    min_opset: int
    # Walks from the anchor (adding the nodes it passes to the Walk); returns the rewrite, or raises Miss.
    match: Callable[[Walk], Rewrite]
    # Whether a node is the rule's fused form (its rewrite writes such nodes): counted before the rule runs,
    # since a graph whose exporter wrote them (LayerNormalization at opset 17 and up) has nothing left to fuse.
    fused_form: Callable[[gs.Node], bool] | None = None


def op_is(op: str) -> Callable[[gs.Node], bool]:
    """A rule's `fused_form`: a node of type `op`."""
    return lambda node: node.op == op


@dataclass
class NodeSpec:
    """A node to insert. Specs, not gs.Nodes: creating a node wires it into the graph, which a rule that may
    still miss must not do."""

    op: str
    inputs: list[gs.Tensor | None]
    attrs: dict[str, object] = field(default_factory=dict)
    dtype: object = None  # of the output, when it is a new intermediate


def replace(walk: Walk, output: gs.Tensor, specs: list[NodeSpec]) -> Rewrite:
    """The rewrite every fusion ends with: the specs compute `output`, and the walked nodes become dead.

    Applies the one shared safety check first: nothing computed inside the match but `output` escapes it."""
    check_removable(walk.graph, walk.nodes, output)

    def splice() -> None:
        for node in walk.nodes:
            if output in node.outputs:
                node.outputs.remove(output)
        previous: gs.Tensor | None = None
        for index, spec in enumerate(specs):
            last = index == len(specs) - 1
            inputs = [previous if tensor is PREVIOUS else tensor for tensor in spec.inputs]
            # graph.layer names a new intermediate uniquely from the prefix given as a string.
            (result,) = walk.graph.layer(
                op=spec.op,
                name=f"{output.name}/{spec.op}",
                attrs=dict(spec.attrs),
                inputs=inputs,
                outputs=[output if last else f"{output.name}/{spec.op}_out"],
            )
            if not last:
                result.dtype = spec.dtype
            previous = result

    return splice


@dataclass
class Fuse:
    """Run `rules` in order over the graph; `name` is the pass's name in the report."""

    rules: Sequence[Rule]
    name: str = "fuse"

    def __call__(self, graph: gs.Graph) -> PassReport:
        opset = int(graph.opset)
        counts: dict[str, int] = {}
        misses: dict[str, list[FusionMiss]] = {}
        reasons: dict[str, dict[str, int]] = {}
        needs_opset: dict[str, int] = {}
        for rule in self.rules:
            matched, missed = 0, list[FusionMiss]()
            if opset < rule.min_opset:
                logger.info("rule %s needs opset %d, the graph has %d: skipped", rule.name, rule.min_opset, opset)
                counts[f"{rule.name}.skipped_opset"] = 1
                needs_opset[rule.name] = rule.min_opset
                continue
            if rule.fused_form is not None:
                counts[f"{rule.name}.already_fused"] = sum(1 for node in graph.nodes if rule.fused_form(node))
            fused: set[int] = set()
            for anchor in [node for node in graph.nodes if node.op == rule.anchor]:
                if id(anchor) in fused:
                    continue
                walk = Walk(anchor, graph)
                try:
                    rewrite = rule.match(walk)
                    if any(id(node) in fused for node in walk.nodes):
                        raise Miss("overlaps a match already rewritten")
                except Unrelated:
                    continue
                except Miss as miss:
                    missed.append({"node": anchor.name, "reason": str(miss)})
                    continue
                rewrite()
                fused.update(id(node) for node in walk.nodes)
                matched += 1
            graph.cleanup()
            counts[f"{rule.name}.matched"] = matched
            counts[f"{rule.name}.missed"] = len(missed)
            if missed:
                misses[rule.name] = missed[:MISSES_KEPT_PER_RULE]
                reasons[rule.name] = dict(Counter(entry["reason"] for entry in missed).most_common())
        changed = any(value for key, value in counts.items() if key.endswith(".matched"))
        details = FusionDetails(misses=misses, reasons=reasons, needs_opset=needs_opset)
        return PassReport(self.name, changed=changed, counts=counts, details=details)
