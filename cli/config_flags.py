"""Command-line options made from CompileConfig's fields: a flag is declared once, by the field it sets, and its
type, choices, help and default are the field's (as Polygraphy's argument groups and Olive's PassConfigParam
declare an option once). `compile` and `calibrate` share the groups; tests/cli/test_config_flags.py checks that
every flag's help states its field's default.

A flag's value reaches the config as an override of its field (a dotted path for `[generation]` and `[build]`);
flags left out override nothing, so a tensorsmith.toml's keys stand."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tensorsmith.compiler.config import CompileConfig

Command = TypeVar("Command", bound=Callable[..., object])


@dataclass(frozen=True)
class Flag:
    """A CompileConfig field as a command-line option. `name`: the flag where it is not --field-name; `convert`:
    the flag's value into the field's (each value of a repeated flag); `choices`: for a str field that its
    validator checks against a table."""

    field: str  # "precision", "generation.max_batch", "build.engine_cache_dir"
    name: str | None = None
    metavar: str | None = None
    convert: Callable[[str], object] | None = None
    choices: Callable[[], Sequence[str]] | None = None
    collect: Callable[[list[Any]], object] | None = None  # a repeated flag's converted values into the field

    @property
    def parameter(self) -> str:
        return self.field.replace(".", "__")


def field_info(path: str, model: type[BaseModel] = CompileConfig) -> FieldInfo:
    """The pydantic field at a dotted `path` of `model` (into its nested models)."""
    head, _, rest = path.partition(".")
    info = model.model_fields[head]
    if not rest:
        return info
    nested = _unwrapped(info.annotation)
    assert isinstance(nested, type) and issubclass(nested, BaseModel), path
    return field_info(rest, nested)


def default_of(info: FieldInfo) -> object:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return None if info.default is PydanticUndefined else info.default


class TableChoice(click.Choice):
    """A choice among a table's names, read when the flag is parsed (a record added to the precision table is a
    choice of `--precision` without another line here)."""

    def __init__(self, names: Callable[[], Sequence[str]]) -> None:
        self.names = names
        super().__init__(list(names()))

    @property  # type: ignore[override]
    def choices(self) -> Sequence[str]:
        return tuple(self.names())

    @choices.setter
    def choices(self, _: Sequence[str]) -> None:  # click's __init__ sets it; the table answers instead
        pass


def option(flag: Flag) -> Callable[[Command], Command]:
    """The click option of `flag`, typed and described by its field."""
    info = field_info(flag.field)
    annotation, default = _unwrapped(info.annotation), default_of(info)
    described = (info.description or "").rstrip(".")
    dashed = flag.field.rpartition(".")[2].replace("_", "-")
    if annotation is bool:  # a switch away from the default
        name = flag.name or (f"--no-{dashed}" if default else f"--{dashed}")
        help_text = f"off: {described} (on by default)." if default else f"{described}."
        return click.option(name, flag.parameter, is_flag=True, default=None, flag_value=not default, help=help_text)
    multiple = typing.get_origin(annotation) in (list, dict)
    kind: click.ParamType | type | None = None
    if flag.choices is not None:
        kind = TableChoice(flag.choices)
    elif typing.get_origin(annotation) is Literal:
        kind = click.Choice([str(value) for value in typing.get_args(annotation)])
    elif annotation is Path:
        kind = click.Path(path_type=Path)
    elif annotation in (int, float):
        kind = annotation
    shown = _shown(default)
    help_text = f"{described} (default: {shown})" if shown else described
    return click.option(
        flag.name or f"--{dashed}",
        flag.parameter,
        type=kind,
        multiple=multiple,
        metavar=flag.metavar,
        default=None,
        help=help_text + ".",
    )


def options(flags: Sequence[Flag]) -> Callable[[Command], Command]:
    """Every flag's option on a command, in the order given."""

    def decorate(function: Command) -> Command:
        for flag in reversed(flags):
            function = option(flag)(function)
        return function

    return decorate


def overrides(flags: Sequence[Flag], values: dict[str, object]) -> dict[str, object]:
    """The config overrides of the flags given on the command line (taken out of `values`): nested by the
    fields' dotted paths, each value converted to its field's."""
    found: dict[str, object] = {}  # nested tables
    for flag in flags:
        value = values.pop(flag.parameter)
        if value is None or value == ():
            continue
        info = field_info(flag.field)
        annotation = _unwrapped(info.annotation)
        if isinstance(value, tuple):
            converted = [flag.convert(item) if flag.convert else item for item in value]
            value = flag.collect(converted) if flag.collect else converted
        elif flag.convert is not None:
            value = flag.convert(str(value))
        elif annotation is Path:
            value = str(Path(str(value)).expanduser().resolve())  # a flag's path is the caller's, not the TOML's
        elif typing.get_origin(annotation) is Literal:
            value = next(choice for choice in typing.get_args(annotation) if str(choice) == value)
        *parents, last = flag.field.split(".")
        into = found
        for parent in parents:
            into = cast(dict[str, object], into.setdefault(parent, {}))  # a table made here
        into[last] = value
    return found


def _unwrapped(annotation: object) -> object:
    """`X` of `X | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kept = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return kept[0] if len(kept) == 1 else annotation
    return annotation


def _shown(default: object) -> str:
    """A default as the help states it; empty where there is none to state (None, empty, False)."""
    if default is None or default is False or default == [] or default == {}:
        return ""
    if isinstance(default, list):
        return ", ".join(str(item) for item in default)
    return str(default)
