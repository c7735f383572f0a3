"""Optimization profiles: (min, opt, max) shapes per input, from the declared dims and the target table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensorsmith.compiler.config import BATCH_DIM, DEFAULT_MAX_SIZE, DimRange
from tensorsmith.compiler.engines.profile import Profile, Shapes
from tensorsmith.compiler.targets import get_target
from tensorsmith.passes.static_cache import CACHE_DIM
from tensorsmith.runtime.manifest import TensorRecord


def decoder_profiles(inputs: Sequence[TensorRecord], dims: Mapping[str, DimRange], target: str) -> list[Profile]:
    """A KV-cache decoder's two profiles. prefill: the prompt, batch 1..B, sequence 1..S, no past; decode: one
    new token, past 1..S-1 (so each call's shapes fall in exactly one profile: past 0 is prefill). With a static
    cache: prefill sequence 2..S, decode sequence 1, the cache S long in both. B is the
    [dims.batch] max within the target's max_batch, S the [dims.total] max."""
    batch = min(dims["batch"].max or get_target(target).max_batch, get_target(target).max_batch)
    longest = dims["total"].max or DEFAULT_MAX_SIZE
    prompt = min(longest, 128)
    # a static cache (dim `cache`, the request's length) has no past length to tell prefill from decode: a
    # one-token prompt runs in the decode profile, so prefill starts at two tokens
    static = any(CACHE_DIM in record.shape for record in inputs)
    sizes = {  # dim → (prefill min, opt, max), (decode min, opt, max)
        "batch": ((1, 1, batch), (1, batch, batch)),
        "sequence": ((2 if static else 1, prompt, longest), (1, 1, 1)),
        "past": ((0, 0, 0), (1, longest // 2, longest - 1)),
        "total": ((1, prompt, longest), (2, longest // 2 + 1, longest)),
        # fixed: TensorRT's KV-cache update takes a static sequence dim (the engines' variants are written so)
        CACHE_DIM: ((longest, longest, longest), (longest, longest, longest)),
    }
    profiles = []
    for index, name in enumerate(("prefill", "decode")):
        shapes: dict[str, Shapes] = {}
        for record in inputs:
            bounds = [(dim, dim, dim) if isinstance(dim, int) else sizes[dim][index] for dim in record.shape]
            shapes[record.name] = (
                tuple(b[0] for b in bounds),
                tuple(b[1] for b in bounds),
                tuple(b[2] for b in bounds),
            )
        profiles.append(Profile(shapes, name))
    return profiles


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
