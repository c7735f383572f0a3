"""The CLI's text flags read into CompileConfig fields: `--input NAME:DTYPE:DIMS` and `--dim NAME=MIN:OPT:MAX`."""

from __future__ import annotations

from pydantic import ValidationError

from tensorsmith.compiler.config import DimRange
from tensorsmith.core.errors import ConfigError

DIM_HINT = "e.g. --dim p2o.DynamicDimension.1=32:640:1280; an empty part keeps its default, as in --dim batch=::16"


def parse_input_flag(text: str) -> dict[str, object]:
    """Parse `--input NAME:DTYPE:DIMS` (e.g. `input_ids:int64:batch,128`) into an InputDecl's fields."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not all(parts):
        raise ConfigError(f"--input {text!r} is not NAME:DTYPE:DIMS", hint="e.g. --input input_ids:int64:batch,128")
    name, dtype, dims_text = parts
    dims: list[int | str] = [int(d) if d.strip().isdigit() else d.strip() for d in dims_text.split(",")]
    # any other text is a dynamic dim's name (`batch-size`, `N?`), or unnamed (`-1`, `?`)
    return {"name": name, "dtype": dtype, "dims": dims}


def parse_dim_flag(text: str) -> tuple[str, dict[str, int]]:
    """Parse `--dim NAME=MIN:OPT:MAX` into the dim's name and its `[dims.NAME]` fields (an empty part is left
    out, so it keeps DimRange's default). The name may be the source's (`p2o.DynamicDimension.1`) or its
    identifier (`p2o_DynamicDimension_1`): the source decides which dims exist."""
    name, _, sizes = text.rpartition("=")
    parts = sizes.split(":")
    if not name.strip() or len(parts) != 3 or not all(part.strip().isdigit() for part in parts if part.strip()):
        raise ConfigError(f"--dim {text!r} is not NAME=MIN:OPT:MAX", hint=DIM_HINT)
    fields = {key: int(part) for key, part in zip(("min", "opt", "max"), parts, strict=True) if part.strip()}
    if 0 in (fields.get("opt"), fields.get("max")):
        raise ConfigError(f"--dim {text!r}: opt and max are at least 1 (min may be 0)", hint=DIM_HINT)
    try:
        DimRange.model_validate(fields)
    except ValidationError as err:  # their order: DimRange's own message
        reason = err.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--dim {text!r}: {reason}", hint=DIM_HINT) from err
    return name.strip(), fields
