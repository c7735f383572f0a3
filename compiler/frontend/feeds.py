"""Example feeds: the inputs used to export a PyTorch model, to verify the compiled graph against its source and to
time the cpu variant."""

from __future__ import annotations

import logging

import numpy as np
import onnx

from tensorsmith.compiler.config import BATCH_DIM, DEFAULT_MAX_SIZE, CompileConfig, DimRange, InputDecl
from tensorsmith.compiler.frontend.verify import SourceRun
from tensorsmith.core.errors import ExportError
from tensorsmith.core.sessions import run_onnx

logger = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]


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


def _tuned_dims(config: CompileConfig) -> set[str]:
    """An ONNX source's dynamic dims that lead no input and are not `batch`: its spatial and sequence dims, which a
    stride or a window may constrain. Leading dims are batches, which nothing constrains: kept small, so that
    verification and the cpu timing stay cheap."""
    if config.source_kind != "onnx":
        return set()  # a PyTorch source is exported at small distinct sizes (the exporters need them distinct)
    leading = {decl.dims[0] for decl in config.inputs if decl.dims}
    return {dim for decl in config.inputs for dim in decl.dims[1:] if isinstance(dim, str)} - leading - {BATCH_DIM}


def example_sizes(config: CompileConfig, size_offset: int = 0, tuned: bool = True) -> dict[str, int]:
    """The size each named dynamic dim takes in the feeds: its declared opt; an ONNX source's spatial dim (with
    `tuned`) the opt its engines are tuned for (compiler/engines/profiles.py: the max, else DEFAULT_MAX_SIZE), since
    a stride-32 network takes no 5×7 image; any other its small example size plus `size_offset` (within its max)."""
    spatial = _tuned_dims(config) if tuned else set()
    sizes = {}
    for dim, size in config.example_sizes().items():
        limits = config.dims.get(dim, DimRange())
        if limits.opt is not None:
            sizes[dim] = limits.opt  # exactly: a stride may need it (opt + 1 would not do)
        elif dim in spatial:
            sizes[dim] = limits.max or DEFAULT_MAX_SIZE
        else:
            sizes[dim] = min(size + size_offset, limits.max) if limits.max else size + size_offset
    return config.with_sums(sizes)


def example_feeds(config: CompileConfig, seed: int = 0, size_offset: int = 0, tuned: bool = True) -> Feeds:
    """One deterministic feed per declared input, dynamic dims at `example_sizes`. Verification's `size_offset` of
    1 puts the small ones one above the export's, so that an exporter that baked in a dynamic dim is caught."""
    rng = np.random.default_rng(seed)
    sizes = example_sizes(config, size_offset, tuned)
    feeds = {}
    for decl in config.inputs:
        shape = tuple(dim if isinstance(dim, int) else sizes[dim] for dim in decl.dims)
        feeds[decl.name] = _example_array(decl, shape, rng)
    return feeds


def _shapes(feeds: Feeds) -> str:
    return ", ".join(f"{name}{list(array.shape)}" for name, array in feeds.items())


def onnx_source_outputs(config: CompileConfig, model: onnx.ModelProto) -> SourceRun:
    """Verification's feeds for an ONNX source, its outputs for them on ONNX Runtime, and whether they are at the
    sizes its engines are tuned for (else, where it fails there, at small ones). Where it runs on neither, its
    error at the first is raised, with both shapes in the hint."""
    origin = str(config.resolve(config.source))
    candidates = [example_feeds(config, seed=1, size_offset=1)]
    small = example_feeds(config, seed=1, size_offset=1, tuned=False)
    if _shapes(small) != _shapes(candidates[0]):
        candidates.append(small)
    errors: list[ExportError] = []
    for feeds in candidates:
        try:
            outputs = run_onnx(model, feeds, origin=origin)
        except ExportError as err:  # the source itself fails: most often a dynamic dim's size it rejects
            errors.append(err)
            continue
        if errors:
            # Only verification falls back: the engines' profiles and the cpu timing keep the tuned sizes.
            logger.warning(
                "%s fails at the sizes its engines are tuned for (%s): %s; verified at %s instead. The "
                "engines' profiles and the cpu timing hold sizes it cannot run: declare the sizes it takes "
                "with --dim NAME=MIN:OPT:MAX",
                origin,
                _shapes(candidates[0]),
                errors[0].message,
                _shapes(feeds),
            )
        return SourceRun(feeds, outputs, tuned=not errors)
    shapes = " and ".join(_shapes(feeds) for feeds in candidates)
    hint = (
        f"it ran on example inputs {shapes}; pass sizes the model accepts with --dim NAME=MIN:OPT:MAX "
        "([dims.NAME] opt), or [[inputs]] value_range for its values"
    )
    raise ExportError(errors[0].message, hint=hint) from errors[0]
