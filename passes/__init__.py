"""Graph rewrites on onnx-graphsurgeon graphs, each returning a report that lands in the manifest."""

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from tensorsmith.passes.attention import ATTENTION
from tensorsmith.passes.attention_scale import ATTENTION_SCALE
from tensorsmith.passes.base import GraphPass, PassDetails, PassReport, SkippedDetails, run_passes
from tensorsmith.passes.canonicalize import Canonicalize
from tensorsmith.passes.fusion import Fuse, Rule
from tensorsmith.passes.gelu import GELU_ERF, GELU_TANH
from tensorsmith.passes.layernorm import LAYERNORM
from tensorsmith.passes.rmsnorm import RMSNORM

# LayerNorm before RMSNorm: both anchor on a Sqrt, and a fused LayerNorm leaves none for RMSNorm to try.
FUSION_RULES = (LAYERNORM, RMSNORM, GELU_ERF, GELU_TANH)


@dataclass
class Skipped:
    """A pass not run, and why: its report says so in the manifest."""

    name: str
    reason: str

    def __call__(self, graph: gs.Graph) -> PassReport:
        return PassReport(self.name, counts={"skipped": 1}, details=SkippedDetails(reason=self.reason))


def default_passes(attention_skipped: str | None = None) -> list[GraphPass]:
    """The graph passes `compile` runs after canonicalize (unless --no-fuse). Attention is fused last: the scale
    folded into the Q projection first costs nothing at run time, and a scale left over becomes the node's.
    `attention_skipped`: why not to fuse attention at all (a target that could not build it)."""
    attention: GraphPass = (
        Fuse((ATTENTION,), name="fuse_attention")
        if attention_skipped is None
        else Skipped("fuse_attention", attention_skipped)
    )
    return [Fuse(FUSION_RULES, name="fuse"), Fuse((ATTENTION_SCALE,), name="fold_attention_scale"), attention]


__all__ = [
    "ATTENTION",
    "ATTENTION_SCALE",
    "FUSION_RULES",
    "GELU_ERF",
    "GELU_TANH",
    "LAYERNORM",
    "RMSNORM",
    "Canonicalize",
    "Fuse",
    "GraphPass",
    "PassDetails",
    "PassReport",
    "Rule",
    "SkippedDetails",
    "default_passes",
    "run_passes",
]
