"""A config's validation error as the user reads it: one line naming the field (or the unknown key, with the keys
known there) and where it came from, a usage error (exit status 2)."""

from __future__ import annotations

import typing

from pydantic import BaseModel, ValidationError

from tensorsmith.core.errors import UsageError


def usage_error(err: ValidationError, origin: str, model: type[BaseModel]) -> UsageError:
    """`err` (validating `model` from `origin`: a TOML file or the command line) as one UsageError."""
    errors = err.errors()
    # An unknown key explains the other errors (a misspelt `source` is also a missing one): name it first.
    first = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
    field = ".".join(str(part) for part in first["loc"])
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    if first["type"] == "extra_forbidden":
        kind = "table" if isinstance(first.get("input"), dict) else "key"
        known = ", ".join(_known_keys(first["loc"], model))
        return UsageError(f"{origin}: unknown {kind} '{field}'{more}", hint=f"known keys there: {known}")
    message = first["msg"].removeprefix("Value error, ")
    where = f"field '{field}': " if field else ""
    value = first.get("input")
    got = f" (got {value!r})" if field and isinstance(value, str | int | float) else ""
    hint = getattr(first.get("ctx", {}).get("error"), "hint", None)
    return UsageError(
        f"{origin}: {where}{message}{more}{'' if hint else got}",
        hint=hint or "`tensorsmith compile --help` describes each flag; a tensorsmith.toml takes the same keys",
    )


def _known_keys(location: tuple[int | str, ...], model: type[BaseModel]) -> list[str]:
    """The keys allowed where an unknown one was found (`location`: pydantic's path to it): the fields of the
    table the location's first key holds (a model, a list or a dict of them), else of `model` itself."""
    field = model.model_fields.get(str(location[0])) if len(location) > 1 else None
    table = _model_in(field.annotation) if field is not None else None
    return [name for name in (table or model).model_fields if name != "base_dir"]


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model an annotation holds: itself, or the element of a list, dict or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None
