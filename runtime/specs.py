"""Tensor specifications and the checks `Model.run` applies to feeds before any backend sees them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Dim = int | str  # an int is a static size; a str names a dynamic axis


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor: its numpy dtype name (e.g. "float32") and its dims (a str dim is dynamic)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def describe(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"{self.name}:{self.dtype}:[{dims}]"


@dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


Limits = Mapping[str, Mapping[str, int | None]]  # dynamic dim name → {"min": ..., "max": ...}


def with_default_token_types(feeds: Mapping[str, object], specs: Sequence[TensorSpec]) -> Mapping[str, object]:
    """`feeds` with `token_type_ids` as zeros shaped like `input_ids` where the model takes them and the caller
    gave none: transformers' BERT-style models treat them as optional and default them so (every token of the
    first segment)."""
    spec = next((spec for spec in specs if spec.name == "token_type_ids"), None)
    if spec is None or spec.name in feeds or "input_ids" not in feeds:
        return feeds
    return {**feeds, spec.name: np.zeros(np.asarray(feeds["input_ids"]).shape, np.dtype(spec.dtype))}


def check_feeds(
    feeds: Mapping[str, object], specs: Sequence[TensorSpec], limits: Limits | None = None
) -> dict[str, np.ndarray]:
    """Return the feeds as numpy arrays, or raise ValueError naming the input and the expected spec.

    Checks names (missing and unexpected), dtypes (no silent casts: a float64 array fed to a float32 input is a
    bug in the caller more often than not), ranks, static dims, that one dynamic dim name has one size, and that
    it lies within `limits` (the artifact's declared min/max: the range its engines' profiles cover).
    """
    expected = {spec.name: spec for spec in specs}
    missing = [name for name in expected if name not in feeds]
    unexpected = [name for name in feeds if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing input(s) {missing}")
        if unexpected:
            parts.append(f"unexpected input(s) {unexpected}")
        wanted = ", ".join(spec.describe() for spec in specs)
        raise ValueError(f"{'; '.join(parts)}; the model takes {wanted}")

    arrays: dict[str, np.ndarray] = {}
    dynamic_sizes: dict[str, tuple[int, str]] = {}
    for name, spec in expected.items():
        array = np.asarray(feeds[name])
        if array.dtype != np.dtype(spec.dtype):
            raise ValueError(
                f"input '{name}' has dtype {array.dtype}, expected {spec.describe()}; "
                f"convert it with .astype(np.{spec.dtype})"
            )
        if array.ndim != len(spec.shape):
            raise ValueError(f"input '{name}' has rank {array.ndim} (shape {array.shape}), expected {spec.describe()}")
        for axis, (size, dim) in enumerate(zip(array.shape, spec.shape, strict=True)):
            if isinstance(dim, int):
                if size != dim:
                    raise ValueError(
                        f"input '{name}' has size {size} on axis {axis}, expected {dim} ({spec.describe()})"
                    )
            elif dim in dynamic_sizes and dynamic_sizes[dim][0] != size:
                other_size, other_input = dynamic_sizes[dim]
                raise ValueError(
                    f"input '{name}' has size {size} on axis {axis} ('{dim}'), but '{other_input}' has "
                    f"{other_size} for the same dim ({spec.describe()})"
                )
            else:
                dynamic_sizes[dim] = (size, name)
                _check_limit(name, axis, size, dim, (limits or {}).get(dim), spec)
        arrays[name] = array
    return arrays


def _check_limit(
    name: str, axis: int, size: int, dim: str, limit: Mapping[str, int | None] | None, spec: TensorSpec
) -> None:
    if limit is None:
        return
    minimum = limit.get("min")
    low, high = 1 if minimum is None else minimum, limit.get("max")  # a min of 0: a dim that may be empty
    if size < low or (high is not None and size > high):
        raise ValueError(
            f"input '{name}' has size {size} on axis {axis} ('{dim}'), outside the artifact's range "
            f"{low}..{high if high is not None else 'any'} ({spec.describe()}); split the batch or recompile with a "
            f"larger [dims.{dim}] max"
        )
