"""Import a `pkg.module:function` named in a config (a model factory, a metric) with errors that name it."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorsmith.core.errors import ConfigError


def first_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()  # torch colours some of its messages
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def import_factory(spec: str) -> Callable[..., Any]:  # the user's function: any signature
    """Import `pkg.module:function`. The working directory is importable, as with `python -m` and uvicorn."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"source {spec!r} is not a factory 'pkg.module:function', an .onnx or a .pt2 file",
            hint="e.g. tensorsmith compile mypkg.models:build_encoder --input x:float32:batch,16",
        )
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module may raise anything while importing
        raise ConfigError(
            f"cannot import '{module_name}' for source {spec!r}: {first_line(err)}",
            hint="is the package installed, or is the working directory the one that holds it?",
        ) from err
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(
            f"'{module_name}' has no callable '{attribute}' (source {spec!r})",
            hint=f"define def {attribute}() -> torch.nn.Module in {module_name}",
        )
    return factory
