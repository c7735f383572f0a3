"""tensorsmith's compiler: config, export, IR, pipeline, artifact.

from tensorsmith.compiler import compile, CompileConfig
result = compile(CompileConfig.from_toml("tensorsmith.toml"), out="build/model")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorsmith.compiler.config import CompileConfig
    from tensorsmith.compiler.pipeline import CompileResult, compile

__all__ = ["CompileConfig", "CompileResult", "compile"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `tensorsmith.compiler.errors` can be imported by passes/ and calibration/ without pulling in
    # the pipeline (which imports them back).
    if name == "CompileConfig":
        from tensorsmith.compiler.config import CompileConfig

        return CompileConfig
    if name in ("compile", "CompileResult"):
        from tensorsmith.compiler import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'tensorsmith.compiler' has no attribute {name!r}")
