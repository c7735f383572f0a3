"""variants/fp16.onnx: the fused graph in fp16 (LayerNorm kept in fp32), measured against fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from tensorsmith.compiler.variants.rewrite import rewrite, variant_path
from tensorsmith.core.metrics import accuracy
from tensorsmith.core.sessions import run_onnx
from tensorsmith.runtime.manifest import VariantRecord, sha256_of


def build_fp16_variant(
    model: onnx.ModelProto, reference_path: Path, feeds: dict[str, np.ndarray], directory: Path
) -> VariantRecord:
    """Write the fp16 variant of `model` and measure it against the fp32 graph at `reference_path` on `feeds`
    (the verification inputs)."""
    from tensorsmith.passes.fp16 import ConvertToFp16

    path = variant_path(directory, "fp16")
    rewrite(model, [ConvertToFp16()], path)
    measured = accuracy(run_onnx(reference_path, feeds), run_onnx(path, feeds))
    return VariantRecord(
        name="fp16",
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        precisions=["fp16", "fp32"],
        accuracy=measured,
        evaluated_on="the verification inputs",
    )
