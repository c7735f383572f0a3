"""Graph rewrites on onnx-graphsurgeon graphs, each returning a report that lands in the manifest."""

from tensorsmith.passes.attention_scale import ATTENTION_SCALE
from tensorsmith.passes.base import GraphPass, PassReport, run_passes
from tensorsmith.passes.canonicalize import Canonicalize
from tensorsmith.passes.fusion import Fuse, Rule
from tensorsmith.passes.gelu import GELU_ERF, GELU_TANH
from tensorsmith.passes.layernorm import LAYERNORM
from tensorsmith.passes.rmsnorm import RMSNORM

# LayerNorm before RMSNorm: both anchor on a Sqrt, and a fused LayerNorm leaves none for RMSNorm to try.
FUSION_RULES = (LAYERNORM, RMSNORM, GELU_ERF, GELU_TANH)


def default_passes() -> list[GraphPass]:
    """The graph passes `compile` runs after canonicalize (unless --no-fuse)."""
    return [Fuse(FUSION_RULES, name="fuse"), Fuse((ATTENTION_SCALE,), name="fold_attention_scale")]


__all__ = [
    "ATTENTION_SCALE",
    "FUSION_RULES",
    "GELU_ERF",
    "GELU_TANH",
    "LAYERNORM",
    "RMSNORM",
    "Canonicalize",
    "Fuse",
    "GraphPass",
    "PassReport",
    "Rule",
    "default_passes",
    "run_passes",
]
