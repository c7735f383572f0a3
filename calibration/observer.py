"""Run the fp32 graph on ONNX Runtime and collect statistics of the tensors that feed quantizable ops.

Only those tensors are exposed as extra outputs; every batch's values are reduced to statistics at once and
dropped, so memory never grows with the number of samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.calibration.data import CalibrationData
from tensorsmith.calibration.statistics import Statistics, TensorStatistics
from tensorsmith.core.errors import CalibrationError
from tensorsmith.core.progress import LogReporter, Reporter
from tensorsmith.core.sessions import Session, recall_run, session_for, session_with_outputs
from tensorsmith.runtime.errors import onnxruntime_reason

logger = logging.getLogger(__name__)


def _session_observing(model: onnx.ModelProto, tensors: list[str], providers: list[str]) -> Session:
    """The observed tensors as extra outputs, added for the session and taken off again (no copy of the weights)."""
    outputs = {output.name for output in model.graph.output}
    added = [onnx.ValueInfoProto(name=name) for name in tensors if name not in outputs]
    model.graph.output.extend(added)
    try:
        return session_for(model, providers)
    finally:
        del model.graph.output[len(model.graph.output) - len(added) :]


class Observer:
    """An ONNX Runtime session over `model` (in memory, or the graph saved at that path: its weights then read
    from its file, not copied) that also returns the `tensors` to observe."""

    def __init__(
        self, model: onnx.ModelProto | Path, tensors: Sequence[str], providers: Sequence[str] | None = None
    ) -> None:
        import onnxruntime

        self.tensors = list(dict.fromkeys(tensors))
        available = set(onnxruntime.get_available_providers())
        chosen = list(providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available])
        try:
            if isinstance(model, Path):
                self.session = session_with_outputs(model, self.tensors, chosen)
            else:
                self.session = _session_observing(model, self.tensors, chosen)
        except Exception as err:  # onnxruntime's own exception types
            raise CalibrationError(
                f"ONNX Runtime cannot run the graph to calibrate it: {onnxruntime_reason(err)}",
                hint="check the source runs on ONNX Runtime: tensorsmith compile it with --precision fp32",
            ) from err
        self.input_names = {value.name for value in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.tensors:  # an empty output list would make ONNX Runtime return every output
            return {}
        feeds = {name: value for name, value in feeds.items() if name in self.input_names}
        values = recall_run(self.session, feeds, self.tensors)  # the feeds' own iterator ran them already
        if values is None:
            values = self.session.run(self.tensors, feeds)
        return dict(zip(self.tensors, values, strict=True))

    def observe_each(
        self, batches: Iterable[dict[str, np.ndarray]], each: Callable[[int, str, np.ndarray], None]
    ) -> None:
        """Every batch's observed tensors, handed to `each(batch, name, values)` as they come (in batch order for
        any one name): through a layerwise session one segment at a time over all the batches, so that its
        weights are read once; else batch by batch."""
        if not self.tensors:
            return
        run_each = getattr(self.session, "run_each", None)  # core/layerwise.LayerwiseSession
        if run_each is not None:
            feeds = [{name: value for name, value in batch.items() if name in self.input_names} for batch in batches]
            run_each(self.tensors, feeds, each)
            return
        for number, batch in enumerate(batches):
            for name, values in self.run(batch).items():
                each(number, name, values)

    def collect(
        self,
        data: CalibrationData,
        reporter: Reporter | None = None,
        per_tensor: Collection[str] | None = None,
        channels: Collection[str] = (),
    ) -> Statistics:
        """One pass over `data`: per-tensor statistics of `per_tensor` (every observed tensor by default) and the
        per-channel max |x| over the last axis of `channels` (for smoothing). Every batch is reduced and dropped."""
        wanted = set(self.tensors if per_tensor is None else per_tensor)
        statistics = Statistics({name: TensorStatistics(name) for name in self.tensors if name in wanted})
        by_channel = set(channels)
        with (reporter or LogReporter()).task("calibration: one pass over the data", data.limit) as advance:
            for batch in data.batches():
                for name, values in self.run(batch).items():
                    if name in wanted:
                        statistics.tensors[name].observe(values)
                    if name in by_channel:
                        flat = np.abs(np.asarray(values, np.float32).reshape(-1, values.shape[-1]))
                        peak = np.max(flat, axis=0)
                        if not np.isfinite(peak).all():  # only then the copy that drops inf and nan
                            peak = np.max(np.where(np.isfinite(flat), flat, 0.0), axis=0)
                        known = statistics.channel_amax.get(name)
                        statistics.channel_amax[name] = peak if known is None else np.maximum(known, peak)
                size = next(iter(batch.values())).shape[0]
                statistics.samples += size
                advance(size)
        return statistics

    def collect_channel_amax(self, data: CalibrationData, reporter: Reporter | None = None) -> dict[str, np.ndarray]:
        """max |x| per channel of the last axis of every observed tensor (one array of that axis's size each)."""
        return self.collect(data, reporter, per_tensor=(), channels=self.tensors).channel_amax
