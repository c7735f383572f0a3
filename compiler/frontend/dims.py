"""Dynamic dims as exporters write them, made into names every stage can use.

ONNX files name dynamic dims however their exporter likes: `batch`, `batch-size`, `p2o.DynamicDimension.0`,
`unk__612`, `N?`, or not at all (a dim with neither value nor name, or `-1`). Inside tensorsmith each dynamic dim
gets one identifier (torch's `Dim`, the compiled graph's `dim_param`, `[dims]` keys and engine profiles all use
it); the name as the source wrote it is kept beside it for the user (errors, the manifest's `dim_names`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from tensorsmith.compiler.config import BATCH_DIM, DEFAULT_MAX_SIZE, CompileConfig, DimRange, InputDecl
from tensorsmith.core.errors import ConfigError

logger = logging.getLogger(__name__)

# What a dynamic dim without a declared range gets (docs/configuration.md): engines get profiles min 1, opt = max
# = 64 (a dim named `batch`: the target's max batch); export and verification use small distinct sizes.
DEFAULT_RANGE = f"min 1, opt = max = {DEFAULT_MAX_SIZE}"


@dataclass(frozen=True)
class DeclaredDims:
    config: CompileConfig  # inputs and [dims] keyed by identifiers
    names: dict[str, str] = field(default_factory=dict)  # identifier → the name as the source wrote it
    defaults: list[str] = field(default_factory=list)  # dynamic dims with no declared range


def identifier_for(text: str) -> str:
    """A Python identifier for a dim name: `p2o.DynamicDimension.0` → `p2o_DynamicDimension_0`."""
    name = re.sub(r"\W+", "_", text).strip("_")
    return name if name and not name[0].isdigit() else f"dim_{name}"


def declare_dims(config: CompileConfig) -> DeclaredDims:
    """Give every dynamic dim of `config.inputs` an identifier, key `[dims]` by them, and find the dims left to
    the default range. `[dims.NAME]` may use either name; one that names no dynamic dim is an error."""
    written = list(dict.fromkeys(dim for decl in config.inputs for dim in decl.dims if isinstance(dim, str)))
    taken = {dim for dim in written if dim.isidentifier()}  # names that are identifiers already keep them
    names = {dim: dim if dim.isidentifier() else _unique(identifier_for(dim), taken) for dim in written}
    inputs = [_renamed(decl, names) for decl in config.inputs]
    dims: dict[str, DimRange] = {}
    for key, limits in config.dims.items():
        identifier = names.get(key) or (key if key in names.values() else None)
        if identifier is None:
            known = f"the dynamic dims are {', '.join(map(repr, names))}" if names else "the inputs have no dynamic dim"
            raise ConfigError(
                f"[dims.{key}] names no dynamic dim of the inputs of {config.source}",
                hint=f"{known}; a static dim needs no range",
            )
        dims[identifier] = limits
    defaults = [identifier for identifier in names.values() if identifier not in dims]
    if defaults:
        batch = f" ('{BATCH_DIM}': the target's max batch)" if BATCH_DIM in defaults else ""
        logger.warning(
            "no range declared for dynamic dim(s) %s: engines use %s%s; to choose, pass --dim "
            "NAME=MIN:OPT:MAX (or set [dims.NAME] min/opt/max in tensorsmith.toml)",
            ", ".join(defaults),
            DEFAULT_RANGE,
            batch,
        )
    renamed = {identifier: written for written, identifier in names.items() if identifier != written}
    return DeclaredDims(config.model_copy(update={"inputs": inputs, "dims": dims}), renamed, defaults)


def _unique(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 2
    while candidate in taken:
        candidate, suffix = f"{name}_{suffix}", suffix + 1
    taken.add(candidate)
    return candidate


def _renamed(decl: InputDecl, names: dict[str, str]) -> InputDecl:
    dims = [names[dim] if isinstance(dim, str) else dim for dim in decl.dims]
    return decl.model_copy(update={"dims": dims})
