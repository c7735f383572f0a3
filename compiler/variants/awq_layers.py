"""AWQ for one INT4 plan, an activation at a time: every activation's statistics from one observed pass over the
calibration prefills (a layer at a time where the graph is large: core/layerwise.py), then each activation's scale
and its readers' clips, kept in the compile's records as they are found (compiler/variants/resume.py), so that a
compile killed in the search resumes at the next activation with the same result."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.calibration import CalibrationData, Observer
from tensorsmith.calibration.awq import ActivationStatistics, search_clip, search_scale
from tensorsmith.compiler.variants.resume import LayerRecords
from tensorsmith.compiler.variants.text_data import prefills_only
from tensorsmith.compiler.variants.weight_matmuls import GraphSource
from tensorsmith.core.mapped_graph import values_unkept
from tensorsmith.core.progress import Reporter


def awq_statistics(
    source: GraphSource,
    activations: list[str],
    data: CalibrationData,
    reporter: Reporter,
    records: LayerRecords | None,
) -> dict[str, ActivationStatistics]:
    """Every activation's statistics: read back where a killed compile kept them all, else one observed pass."""
    kept = {name: records.get(f"statistics/{name}") for name in activations} if records is not None else {}
    if kept and all(arrays is not None for arrays in kept.values()):
        return {
            name: ActivationStatistics(arrays["total"], int(arrays["count"]), [arrays["sample"]])
            for name, arrays in kept.items()
            if arrays is not None
        }
    observer = Observer(source, activations)
    reporter.stage(f"int4 awq: activation statistics of {len(activations)} inputs (one pass over the prefills)")
    statistics: dict[str, ActivationStatistics] = {}

    def observe(_: int, name: str, values: np.ndarray) -> None:
        statistics.setdefault(name, ActivationStatistics()).observe(values)

    observer.observe_each(prefills_only(data).batches(), observe)  # a layerwise graph's weights read once
    del observer  # its session holds the fp32 weights
    for name, found in statistics.items() if records is not None else ():
        assert records is not None and found.total is not None
        records.put(
            f"statistics/{name}",
            {"total": found.total, "count": np.array(found.count, np.int64), "sample": found.sample},
        )
    return statistics


def awq_search(statistics: ActivationStatistics, readers: list[gs.Constant], block: int) -> dict[str, np.ndarray]:
    """AWQ's scale for one activation (searched on its readers' weights side by side) and each reader's clips."""
    own_weights = [np.asarray(values_unkept(weight), dtype=np.float32) for weight in readers]  # read for this use
    scale, alpha, relative = search_scale(statistics, own_weights, block)
    clips = {f"clip{index}": search_clip(statistics, weight, scale, block) for index, weight in enumerate(own_weights)}
    return {"scale": scale, "alpha": np.array(alpha, np.float64), "relative": np.array(relative, np.float64), **clips}
