"""report.json's shape: what collect.py writes and html.py renders, a TypedDict a section (JSON as written)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class StepRow(TypedDict):
    name: str
    seconds: float
    peak_rss_bytes: int | None


class PassRow(TypedDict):
    name: str
    changed: bool
    seconds: float
    variant: str


class Miss(TypedDict):
    """A fusion rule's miss, as passes/fusion.py records it."""

    node: str
    reason: str


# `pass` is a keyword: the functional form
FusionRow = TypedDict(
    "FusionRow",
    {"pass": str, "rule": str, "matched": int, "missed": int, "already_fused": int, "misses": list[Miss]},
)


class CalibrationRow(TypedDict):
    method: str
    samples: int


class HistogramRow(TypedDict):
    tensor: str
    amax: float
    range: float
    threshold: float
    method: str
    quantized: bool
    counts: list[float]


class BudgetOutcome(TypedDict):
    met: bool
    achieved: float | None
    instead: (
        str | None
    )  # what its targets run instead and why: the fp32 reference (variants/fallback.py), a dynamic one


class SensitivityRow(TypedDict):
    name: str
    module: str
    sensitivity: float
    cost: float | None


class PlanRow(TypedDict):
    name: str
    module: str
    op: str
    precision: str
    sensitivity: float | None
    reason: str


class VariantRow(TypedDict):
    name: str
    precisions: list[str]
    accuracy: dict[str, float]
    evaluated_on: str
    bytes: int | None


class EngineRow(TypedDict):
    target: str
    variant: str
    status: str
    builder: str
    reason: str
    # a target with an engine only
    builder_version: NotRequired[str]
    compute_capability: NotRequired[str]
    bytes: NotRequired[int | None]
    build_seconds: NotRequired[float | None]
    cache: NotRequired[str]


class Report(TypedDict):
    schema_version: int
    artifact: str
    tensorsmith_version: str
    source: dict[str, object]  # runtime/manifest.SourceRecord's JSON
    steps: list[StepRow]
    passes: list[PassRow]
    fusion: list[FusionRow]
    calibration: CalibrationRow | None
    histograms: list[HistogramRow]
    budget: str | None
    budget_outcomes: dict[str, BudgetOutcome]
    float_instead: dict[str, str]  # variant → what the cpu runs instead of it and why, budget or not
    sensitivity: dict[str, list[SensitivityRow]]
    plan: dict[str, list[PlanRow]]
    cpu: dict[str, object] | None  # compiler/variants/precision_plan.CpuChoice's JSON
    variants: list[VariantRow]
    engines: list[EngineRow]
