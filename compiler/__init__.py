"""tensorsmith's compiler: the stages from a source to an artifact directory (docs/architecture.md).

from tensorsmith.compiler import compile, CompileConfig
result = compile(CompileConfig.from_toml("tensorsmith.toml"), out="build/model")

The names are imported on first use: an engine build's child process imports `compiler.engines` alone, not the
pipeline's every stage (0.6 s of imports for each build).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorsmith.compiler.config import CompileConfig
    from tensorsmith.compiler.pipeline import CompileResult, compile

__all__ = ["CompileConfig", "CompileResult", "compile"]


def __getattr__(name: str) -> object:
    if name == "CompileConfig":
        from tensorsmith.compiler.config import CompileConfig

        return CompileConfig
    if name in ("CompileResult", "compile"):
        from tensorsmith.compiler import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'tensorsmith.compiler' has no attribute {name!r}")
