"""Example feeds: the inputs used to export a PyTorch model and to verify the compiled graph against it."""

from __future__ import annotations

import numpy as np

from tensorsmith.compiler.config import CompileConfig, InputDecl


def _example_array(decl: InputDecl, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(decl.dtype)
    if decl.value_range is not None:
        low, high = decl.value_range
        if dtype.kind in "iu":
            return rng.integers(int(low), int(high), size=shape).astype(dtype)
        return rng.uniform(low, high, size=shape).astype(dtype)
    if dtype.kind == "b":
        return np.ones(shape, dtype=dtype)
    if dtype.kind in "iu":
        # Ones are valid for the usual integer inputs: token ids, attention masks, segment ids.
        return np.ones(shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype)


def example_feeds(config: CompileConfig, seed: int = 0, size_offset: int = 0) -> dict[str, np.ndarray]:
    """One deterministic feed per declared input, dynamic dims at their example sizes plus `size_offset`
    (kept within each dim's declared max)."""
    rng = np.random.default_rng(seed)
    sizes = {}
    for dim, size in config.example_sizes().items():
        limit = config.dims[dim].max if dim in config.dims else None
        sizes[dim] = min(size + size_offset, limit) if limit else size + size_offset
    sizes = config.with_sums(sizes)
    feeds = {}
    for decl in config.inputs:
        shape = tuple(dim if isinstance(dim, int) else sizes[dim] for dim in decl.dims)
        feeds[decl.name] = _example_array(decl, shape, rng)
    return feeds
