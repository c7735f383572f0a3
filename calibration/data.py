"""Calibration data: an .npz (arrays named like the inputs, samples stacked on axis 0), a directory of them, or
any iterable of feed dicts; checked against the model's inputs and re-batched."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensorsmith.core.errors import CalibrationError
from tensorsmith.runtime.specs import TensorSpec

Feeds = dict[str, np.ndarray]


def _load_npz(path: Path) -> Feeds:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise CalibrationError(f"cannot read calibration data {path}: {err}", hint="pass an .npz of arrays") from err


def _check(feeds: Feeds, specs: Sequence[TensorSpec], origin: str) -> int:
    """Check names, dtypes, ranks and static dims of stacked samples; return the number of samples."""
    expected = {spec.name: spec for spec in specs}
    missing = sorted(set(expected) - set(feeds))
    unexpected = sorted(set(feeds) - set(expected))
    if missing or unexpected:
        raise CalibrationError(
            f"{origin}: arrays {sorted(feeds)} do not match the model's inputs {sorted(expected)}"
            + (f" (missing {missing})" if missing else "")
            + (f" (unexpected {unexpected})" if unexpected else ""),
            hint="name each array after a model input and stack samples on axis 0",
        )
    samples = {name: array.shape[0] if array.ndim else 0 for name, array in feeds.items()}
    if len(set(samples.values())) != 1:
        raise CalibrationError(
            f"{origin}: arrays hold different numbers of samples {samples}", hint="stack one sample per row"
        )
    for name, spec in expected.items():
        array = feeds[name]
        if array.dtype != np.dtype(spec.dtype):
            raise CalibrationError(
                f"{origin}: array '{name}' is {array.dtype}, the input is {spec.describe()}",
                hint=f"save it as {spec.dtype}",
            )
        if array.ndim != len(spec.shape):
            raise CalibrationError(
                f"{origin}: array '{name}' has shape {list(array.shape)}, the input is {spec.describe()}",
                hint="samples are stacked on axis 0, which is the batch axis",
            )
        for axis, (size, dim) in enumerate(zip(array.shape[1:], spec.shape[1:], strict=True), start=1):
            if isinstance(dim, int) and size != dim:
                raise CalibrationError(
                    f"{origin}: array '{name}' has size {size} on axis {axis}, the input is {spec.describe()}",
                    hint="samples are stacked on axis 0; the other axes must match the input",
                )
        if array.dtype.kind == "f" and array.size and not np.isfinite(array).any():
            raise CalibrationError(f"{origin}: array '{name}' holds no finite value", hint="check the data")
    count = next(iter(samples.values()))
    if count == 0:
        raise CalibrationError(f"{origin} holds no samples", hint="stack at least one sample on axis 0")
    return count


@dataclass
class CalibrationData:
    """Samples from `source`, at most `limit`, yielded in batches of `batch_size`; iterate it once per pass."""

    source: str | Path | Iterable[Feeds]
    inputs: Sequence[TensorSpec]
    batch_size: int = 16
    limit: int | None = None
    skip: int = 0  # samples passed over first (to hold some out for evaluation)

    def _chunks(self) -> Iterator[tuple[Feeds, str]]:
        if isinstance(self.source, (str, Path)):
            path = Path(self.source)
            if path.is_dir():
                files = sorted(path.glob("*.npz"))
                if not files:
                    raise CalibrationError(f"{path} holds no .npz files", hint="pass an .npz or a folder of them")
                for file in files:
                    yield _load_npz(file), str(file)
            elif path.is_file():
                yield _load_npz(path), str(path)
            else:
                raise CalibrationError(f"calibration data {path} does not exist", hint="check --calibration")
        else:
            for index, feeds in enumerate(self.source):
                yield {name: np.asarray(value) for name, value in feeds.items()}, f"calibration item {index}"

    def batches(self) -> Iterator[Feeds]:
        remaining = self.limit
        seen = 0
        to_skip = self.skip
        for feeds, origin in self._chunks():
            count = _check(feeds, self.inputs, origin)
            first = min(to_skip, count)
            to_skip -= first
            for start in range(first, count, self.batch_size):
                stop = min(start + self.batch_size, count)
                if remaining is not None:
                    stop = min(stop, start + remaining)
                    if stop <= start:
                        return
                    remaining -= stop - start
                seen += stop - start
                yield {name: array[start:stop] for name, array in feeds.items()}
        if seen == 0:
            raise CalibrationError(
                f"the calibration data holds no samples{f' after the first {self.skip}' if self.skip else ''}",
                hint="check --calibration",
            )

    def count(self) -> int:
        """Samples that `batches()` yields (reads the data once)."""
        return sum(next(iter(batch.values())).shape[0] for batch in self.batches())
