"""tensorsmith's compiler: the stages from a source to an artifact directory (docs/architecture.md).

from tensorsmith.compiler import compile, CompileConfig
result = compile(CompileConfig.from_toml("tensorsmith.toml"), out="build/model")
"""

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.pipeline import CompileResult, compile

__all__ = ["CompileConfig", "CompileResult", "compile"]
