"""Pass reports stored as JSON and read back typed: the export cache keeps the fused graph's reports beside it.

A report's details are stored with their type's name, found again in `DETAILS_TYPES`, the one table of every
pass's details (a pass with details of a new type adds it here).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tensorsmith.passes.base import PassDetails, PassReport, SkippedDetails
from tensorsmith.passes.cache_graph import StaticCacheDetails
from tensorsmith.passes.canonicalize import CanonicalizeDetails
from tensorsmith.passes.embeddings import EmbeddingDetails
from tensorsmith.passes.fp8_weights import Fp8WeightDetails
from tensorsmith.passes.fp16 import HalfDetails
from tensorsmith.passes.fusion import FusionDetails
from tensorsmith.passes.int4 import Int4Details
from tensorsmith.passes.kv_quantize import QuantizedCacheDetails
from tensorsmith.passes.last_position import LastPositionDetails
from tensorsmith.passes.nvfp4 import Nvfp4Details
from tensorsmith.passes.outlier_neurons import OutlierDetails
from tensorsmith.passes.quantize import QdqDetails
from tensorsmith.passes.smooth import SmoothDetails
from tensorsmith.passes.softmax_floor import SoftmaxFloorDetails
from tensorsmith.passes.tied_projection import TiedProjectionDetails
from tensorsmith.passes.weight_formats.base import WeightOnlyDetails
from tensorsmith.passes.weight_formats.stacked import StackedDetails

DETAILS_TYPES: dict[str, type[PassDetails]] = {
    kind.__name__: kind
    for kind in (
        PassDetails,
        SkippedDetails,
        CanonicalizeDetails,
        EmbeddingDetails,
        Fp8WeightDetails,
        HalfDetails,
        FusionDetails,
        Int4Details,
        QuantizedCacheDetails,
        LastPositionDetails,
        Nvfp4Details,
        OutlierDetails,
        QdqDetails,
        SmoothDetails,
        SoftmaxFloorDetails,
        StaticCacheDetails,
        TiedProjectionDetails,
        WeightOnlyDetails,
        StackedDetails,
    )
}


class StoredReport(BaseModel):
    """A `PassReport` as JSON: its fields, and its details with their type's name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    changed: bool
    counts: dict[str, int]
    seconds: float
    variant: str
    details: dict[str, object]
    details_type: str

    @classmethod
    def of(cls, report: PassReport) -> StoredReport:
        return cls(
            name=report.name,
            changed=report.changed,
            counts=report.counts,
            seconds=report.seconds,
            variant=report.variant,
            details=report.details.as_json(),
            details_type=type(report.details).__name__,
        )

    def report(self) -> PassReport:
        details = DETAILS_TYPES[self.details_type].model_validate(self.details)
        return PassReport(self.name, self.changed, dict(self.counts), self.seconds, details, self.variant)
