"""Where a checkpoint directory declares that its weights are quantized: config.json's `quantization_config`, or,
for Model Optimizer's older exports that carry none, `hf_quant_config.json` beside it (`{"producer": ...,
"quantization": {"quant_algo": "FP8" | "NVFP4" | ..., "exclude_modules": [...]}}`, the file vLLM and TensorRT-LLM
read for such a checkpoint), read as a `modelopt` quantization_config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.core.errors import ConfigError

FIELD = "quantization_config"
MODELOPT_FILE = "hf_quant_config.json"
# gpt-oss's experts (compiler/frontend/mxfp4_weights.py): read dequantized, their codes kept where a target runs them
MXFP4_METHOD = "mxfp4"  # quant_method, not a precision


@dataclass(frozen=True)
class Declared:
    settings: object  # the quantization_config mapping as published (checked by its reader)
    where: str  # the file and field, for messages


def declared_quantization(directory: Path, config: Mapping[str, object]) -> Declared | None:
    """The quantization `config` (the directory's config.json) or Model Optimizer's file declares; None for none."""
    if config.get(FIELD):
        return Declared(config[FIELD], f"{directory / 'config.json'} {FIELD}")
    path = directory / MODELOPT_FILE
    if not path.is_file():
        return None
    try:
        published = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path} is not readable JSON: {err}", hint="the file Model Optimizer exported") from err
    settings = published.get("quantization") if isinstance(published, dict) else None
    if not settings or (isinstance(settings, dict) and not settings.get("quant_algo")):
        return None  # none declared, or only the KV cache's (`kv_cache_quant_algo`): the weights are as stored
    settings = {"quant_method": "modelopt", **settings} if isinstance(settings, dict) else settings
    return Declared(settings, f"{path} quantization")


def declared_method(directory: Path, config: Mapping[str, object] | None = None) -> str | None:
    """The `quant_method` a checkpoint directory declares (`config`: its config.json, where already read); None for
    none, or where it cannot be read (not a checkpoint directory, or refused naming the file when the source is
    read)."""
    try:
        read = config if config is not None else json.loads((directory / "config.json").read_text())
        declared = declared_quantization(directory, read)
    except (OSError, ValueError, AttributeError, ConfigError):
        return None
    if declared is None:
        return None
    return str(declared.settings.get("quant_method", "unnamed")) if isinstance(declared.settings, dict) else "unnamed"


def declares_quantization(directory: Path) -> bool:
    """Whether a checkpoint directory declares quantized weights whose codes the compile can take: they are then
    the default (compiler/frontend/quantized_checkpoint.py reads them). MXFP4's are read dequantized."""
    method = declared_method(directory)
    return method is not None and method != MXFP4_METHOD
