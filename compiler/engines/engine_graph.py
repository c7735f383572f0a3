"""The graph an engine is built from: the variant itself, or for a decoder the variant with its vocabulary
projection computed at the last position only (passes/last_position.py), reading a tied embedding table through a
Transpose (passes/tied_projection.py). Perplexity is measured on the variants, which keep every position; the
engines, which only generate, never pay for the others."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx_graphsurgeon as gs

from tensorsmith.core.ir import load_onnx, save_onnx
from tensorsmith.passes import run_passes
from tensorsmith.passes.last_position import LastPositionLogits
from tensorsmith.passes.tied_projection import TiedProjection
from tensorsmith.runtime.manifest import VariantRecord, sha256_of


@contextmanager
def engine_graph(directory: Path, variant: VariantRecord, decoder: bool) -> Iterator[tuple[Path, str]]:
    """(path, sha256) of the ONNX file to build `variant`'s engine from; a decoder's is a scratch file inside
    `directory`, removed afterwards."""
    path = directory / variant.path
    if not decoder:
        yield path, variant.sha256
        return
    graph = gs.import_onnx(load_onnx(path))
    run_passes(graph, [TiedProjection(), LastPositionLogits()])  # the table once: passes/tied_projection.py
    with tempfile.TemporaryDirectory(prefix=".engine-graph-", dir=directory) as scratch:
        sliced = Path(scratch) / path.name
        save_onnx(gs.export_onnx(graph), sliced)
        yield sliced, sha256_of(sliced)
