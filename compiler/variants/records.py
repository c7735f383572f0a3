"""The records every builder writes, in one place: a variant's manifest record, and precision.json's layer rows'
shared figure (the quantized fraction)."""

from __future__ import annotations

from pathlib import Path

from tensorsmith.runtime.manifest import VariantRecord, sha256_of


def variant_record(
    directory: Path, path: Path, name: str, precisions: list[str], accuracy: dict[str, float], evaluated_on: str
) -> VariantRecord:
    """The manifest's record of the variant file at `path` (inside the artifact `directory`)."""
    return VariantRecord(
        name=name,
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        precisions=precisions,
        accuracy=accuracy,
        evaluated_on=evaluated_on,
    )
