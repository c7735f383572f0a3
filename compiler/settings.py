"""The tables of `tensorsmith.toml` that configure a stage rather than the model: `[build]` (TensorRT builder
settings) and `[generation]` (a decoder's lengths)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tensorsmith.compiler.targets import Builder
from tensorsmith.core.precisions import FP8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BuildConfig(_Strict):
    """`[build]`: TensorRT builder settings for the engines `compile` builds."""

    builder: Literal["auto", "tensorrt", "tensorrt-rtx"] = Field(
        "auto", description="auto: tensorrt-rtx where it covers the target, else tensorrt on a matching GPU"
    )
    optimization_level: int | None = Field(None, ge=0, le=5, description="TensorRT's builder optimization level")
    workspace_mb: int | None = Field(None, ge=1, description="workspace memory pool limit")
    hardware_compatibility: Literal["none", "ampere+", "same-compute-capability"] = "none"
    detailed_profiling: bool = Field(True, description="keep layer names/precisions for the engine inspector")
    timing_cache_dir: Path | None = Field(
        Path("~/.cache/tensorsmith/timing-cache"), description="data-centre TensorRT's timing caches, per target"
    )
    engine_cache_dir: Path | None = Field(
        None, description="reuse engines built before from the same graph and settings (else $TENSORSMITH_ENGINE_CACHE)"
    )

    @property
    def requested_builder(self) -> Builder | None:
        """The builder asked for; None for auto (compiler/engines/records.choose_builder decides)."""
        return None if self.builder == "auto" else self.builder

    @property
    def workspace_bytes(self) -> int | None:
        return self.workspace_mb << 20 if self.workspace_mb else None

    def cache_settings(self) -> dict[str, object]:
        """The settings an engine depends on (the engine cache's key): not where caches live, nor who builds."""
        return {
            "optimization_level": self.optimization_level,
            "workspace_bytes": self.workspace_bytes,
            "hardware_compatibility": self.hardware_compatibility,
            "detailed_profiling": self.detailed_profiling,
        }


class GenerationConfig(_Strict):
    """`[generation]`: how long and how wide a decoder's requests may be (its engines' profiles and the cache)."""

    max_sequence_length: int | None = Field(
        None,
        ge=2,
        description="a decoder's prompt and new tokens together, at most (unset: the config's positions, capped at "
        "2048)",
    )
    max_batch: int | None = Field(
        None,
        ge=1,
        description="a decoder's requests per call, at most (unset: 8; engines: at most the target's max_batch)",
    )
    kv_cache: Literal["static", "dynamic"] | None = Field(
        None,
        description="static: the cache as long as the request, written in place (TensorScatter, opset 24); "
        "dynamic: Optimum's and ONNX Runtime GenAI's growing cache, for their tools. Default: static where the "
        "graph's attention became ONNX Attention, else dynamic (the manifest says why)",
    )
    kv_cache_precision: str | None = Field(
        None,
        description="fp8: the engines' static cache in FLOAT8E4M3FN, a per-tensor scale per layer's keys and values "
        "(amax / 448 on the fp32 graph), its perplexity measured on the evaluation text; GPU targets of sm_89 and up. "
        "Default: the variant's own dtype (fp16, bf16; fp32 for the cpu)",
    )

    @field_validator("kv_cache_precision")
    @classmethod
    def _fp8_only(cls, value: str | None) -> str | None:
        if value is not None and value != FP8.name:
            raise ValueError(f"kv_cache_precision takes {FP8.name} (or nothing: the variant's own dtype)")
        return value
