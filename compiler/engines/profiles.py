"""Optimization profiles: (min, opt, max) shapes per input, from the declared dims and the target table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensorsmith.compiler.config import BATCH_DIM, DEFAULT_MAX_SIZE, DimRange
from tensorsmith.compiler.targets import get_target
from tensorsmith.runtime.manifest import TensorRecord


@dataclass
class Profile:
    """One optimization profile: (min, opt, max) shapes per input."""

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def as_record(self) -> dict[str, object]:
        return {name: {"min": s[0], "opt": s[1], "max": s[2]} for name, s in self.shapes.items()}


def profile_for(inputs: Sequence[TensorRecord], dims: Mapping[str, DimRange], target: str | None = None) -> Profile:
    """Min/opt/max shapes from the declared dims: `[dims.NAME] min/opt/max`, else 1 / max / 64 (for `batch`,
    the target architecture's max_batch)."""
    shapes = {}
    for record in inputs:
        low: list[int] = []
        best: list[int] = []
        high: list[int] = []
        for dim in record.shape:
            if isinstance(dim, int):
                sizes = (dim, dim, dim)
            else:
                limits = dims.get(dim, DimRange())
                default = get_target(target).max_batch if dim == BATCH_DIM and target else DEFAULT_MAX_SIZE
                maximum = limits.max or max(limits.opt or 1, default)
                sizes = (limits.min, limits.opt or maximum, maximum)
            for bound, size in zip((low, best, high), sizes, strict=True):
                bound.append(size)
        shapes[record.name] = (tuple(low), tuple(best), tuple(high))
    return Profile(shapes)
