"""`[[overrides]]` of tensorsmith.toml: layers pinned to a precision before any search (calibration/layers.py
applies them). Apart from the layers, so that reading a config loads no graph library."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tensorsmith.core.precisions import overridable


class Override(BaseModel):
    """`[[overrides]]`: pin the matching layers to a precision before any search."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: str = Field(description="glob over the ONNX node name, the PyTorch module path, or the op type")
    precision: str = Field(
        description="a precision of the table that [[overrides]] take (core/precisions.py): calibrated ones "
        "quantize weights and activations, weight-only ones a decoder's weight layers"
    )

    @field_validator("precision")
    @classmethod
    def _overridable(cls, name: str) -> str:
        if name not in overridable():
            raise ValueError(f"[[overrides]] precision '{name}' is not one of {', '.join(overridable())}")
        return name
