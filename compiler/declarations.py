"""The records a config declares its inputs with: an input's name, dtype and dims, and a dynamic dim's range."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["float32", "float16", "int64", "int32", "int8", "uint8", "bool"]  # dtypes, not precisions


class StrictModel(BaseModel):
    """A record whose unknown keys are errors (a misspelt key is never silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class InputDecl(StrictModel):
    """One model input. A dim given as a name (e.g. "batch", or any string an exporter wrote) is dynamic; so is
    `-1`, `?` or an empty name, which becomes NAME_dimAXIS (e.g. `x_dim2`)."""

    name: str = Field(description="the forward() argument / ONNX graph input name")
    dtype: DType = Field(description="numpy dtype name")
    dims: list[int | str] = Field(description="sizes; a name makes that axis dynamic")
    value_range: tuple[float, float] | None = Field(
        None, description="[low, high) of example values used for export and verification (e.g. token ids)"
    )

    @model_validator(mode="after")
    def _dims_named(self) -> InputDecl:
        for axis, dim in enumerate(self.dims):
            if dim in (-1, "-1", "?") or (isinstance(dim, str) and not dim.strip()):
                self.dims[axis] = f"{self.name}_dim{axis}"
            elif isinstance(dim, int) and dim < 1:
                raise ValueError(f"static dim {dim} of input '{self.name}' must be >= 1 (-1 makes it dynamic)")
        return self

    def describe(self) -> str:
        return f"{self.name}:{self.dtype}:{','.join(str(d) for d in self.dims)}"


class DimRange(StrictModel):
    """Sizes of one dynamic dim: `opt` is also the size used for export and verification."""

    min: int = Field(1, ge=0, description="0 only for a dim that may be empty, like a decoder's past length")
    opt: int | None = Field(None, ge=1)
    max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> DimRange:
        sizes = [s for s in (self.min, self.opt, self.max) if s is not None]
        if sizes != sorted(sizes):
            raise ValueError(f"need min <= opt <= max, got min={self.min} opt={self.opt} max={self.max}")
        return self
