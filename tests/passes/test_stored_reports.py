"""Pass reports stored as JSON (the export cache keeps them) read back with their details typed, and every
pass's details type in the one table that reads them."""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

import tensorsmith.passes
from tensorsmith.passes import Canonicalize, PassDetails
from tensorsmith.passes.canonicalize import CanonicalizeDetails
from tensorsmith.passes.fp16 import HalfDetails
from tensorsmith.passes.half_regions import RangeKept
from tensorsmith.passes.stored_reports import DETAILS_TYPES, StoredReport
from tests.passes.test_canonicalize import graph_with_constant_subexpressions


def test_every_pass_details_type_is_in_the_table() -> None:
    for module in pkgutil.iter_modules(tensorsmith.passes.__path__):
        importlib.import_module(f"tensorsmith.passes.{module.name}")
    defined = {kind.__name__: kind for kind in _subclasses(PassDetails)}
    assert defined == {name: kind for name, kind in DETAILS_TYPES.items() if name != "PassDetails"}


def test_a_report_reads_back_with_its_details_typed() -> None:
    _, report = Canonicalize(opset=20)(graph_with_constant_subexpressions(opset=13))
    stored = StoredReport.model_validate_json(StoredReport.of(report).model_dump_json())
    assert stored.details_type == "CanonicalizeDetails"
    again = stored.report()
    assert isinstance(again.details, CanonicalizeDetails) and again.details.opset_after == 20
    assert again == report
    # a nested record (a node kept in fp32 for range) comes back as one
    why = RangeKept(op="MatMul", tensor="w", reason="weight", max_abs=float(np.float32(9e4)))
    kept = StoredReport.of(report).model_copy(
        update={"details": HalfDetails(kept_fp32_for_range={"n": why}).as_json(), "details_type": "HalfDetails"}
    )
    assert StoredReport.model_validate_json(kept.model_dump_json()).report().details == HalfDetails(
        kept_fp32_for_range={"n": why}
    )


def _subclasses(kind: type[PassDetails]) -> list[type[PassDetails]]:
    found = []
    for sub in kind.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
