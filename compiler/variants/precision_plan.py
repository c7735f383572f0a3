"""precision.json: the per-layer plan and what it was measured on, one model written and read by this class."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, field_validator

from tensorsmith.compiler.targets import Request
from tensorsmith.core.errors import ArtifactError
from tensorsmith.core.files import replace_file
from tensorsmith.core.precisions import PRECISIONS, float_regions

FLOAT_NAMES = tuple(name for name, record in PRECISIONS.items() if record.is_float)

PRECISION_PLAN = "precision.json"
SEARCHED = "search"  # how the reason of a layer placed by a budget search begins (the summary names the budget)


class LayerChoice(BaseModel):
    name: str
    module: str
    op: str
    inputs: list[str] = Field(default_factory=list, description="the activation tensors it quantizes")
    flops: int
    precision: str
    sensitivity: float | None = Field(None, description="the budget's metric with only this layer quantized")
    reason: str = Field(description="why this precision; a float layer's says why it is not quantized")


class SessionChoice(BaseModel):
    disabled_optimizers: list[str] = Field(default_factory=list)
    latency_ms_batch8: dict[str, float] = Field(default_factory=dict, description="per ONNX Runtime setting")


class CpuChoice(BaseModel):
    """The cpu target's recipe: which variant runs fastest within the budget, on which backend, and how."""

    variant: str
    reason: str
    latency_ms_batch8: dict[str, float] = Field(default_factory=dict, description="per variant, ORT defaults")
    latency_ms_by_backend: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="per variant, per cpu backend (ORT with its defaults): what chose the pair"
    )
    metric: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="the metric that chose, per candidate (MatMulNBits' accuracy levels)"
    )
    dynamic_preparation: dict[str, dict[str, object]] = Field(
        default_factory=dict, description="what preparing the dynamic variant's graph did, per pass"
    )
    onnxruntime_session: SessionChoice = Field(default_factory=SessionChoice)


class FloatInstead(BaseModel):
    """A quantized variant its targets do not run, with the float variant they run instead and why."""

    variant: str
    reason: str


class RecipePlan(BaseModel):
    """One quantized variant's plan."""

    precision: str
    float_regions: str
    met: bool
    achieved: float | None = None
    quantized_flops_fraction: float
    evaluations: int
    embeddings: str
    verify_retries: int = 0
    layers: list[LayerChoice] = Field(default_factory=list)
    targets: list[str] = Field(default_factory=list)
    cpu: CpuChoice | None = None
    weight_levels: dict[str, str] = Field(
        default_factory=dict, description="a decoder's auto: each weight precision, considered or why not"
    )
    stacked_experts: str = Field(
        "", description="a mixture of experts' stacked weights: the format they are stored in, or why float"
    )
    float_instead: FloatInstead | None = Field(
        None, description="set where the cpu target runs the fp32 reference instead (compiler/variants/fallback.py)"
    )


class PrecisionPlan(BaseModel):
    """What `--precision` asked for and, for quantized variants, each layer's precision and why."""

    precision: Request = Field(description="the --precision request; `tensorsmith build` gives new targets its recipe")
    fallback_float: str = Field(
        float_regions(on_gpu=True).name,
        description="the float type a target takes that cannot run a weight-only request (a bf16 checkpoint's bf16)",
    )
    evaluated_on: str = ""
    budget: str | None = None
    sensitivity_samples: int | None = None
    recipes: dict[str, RecipePlan] = Field(default_factory=dict, description="variant name → its plan")

    @field_validator("fallback_float")
    @classmethod
    def _a_float(cls, value: str) -> str:
        if value not in PRECISIONS or not PRECISIONS[value].is_float:
            raise ValueError(f"{value!r} is not a float precision ({', '.join(FLOAT_NAMES)})")
        return value

    def write(self, directory: Path) -> None:
        text = json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2) + "\n"
        replace_file(directory / PRECISION_PLAN, text.encode())

    @classmethod
    def read(cls, directory: Path) -> PrecisionPlan | None:
        """The artifact's plan; None for an artifact written before every compile wrote one."""
        path = directory / PRECISION_PLAN
        if not path.is_file():
            return None
        try:
            return cls.model_validate_json(path.read_text())
        except OSError as err:
            raise ArtifactError(f"{path} cannot be read: {err}", hint="recompile the artifact") from err
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise ArtifactError(
                f"{path} is not a precision plan: field '{field}': {first['msg']}", hint="recompile the artifact"
            ) from err
