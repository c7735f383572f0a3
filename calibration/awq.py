"""AWQ (Lin et al., 2023) for INT4 weight-only MatMuls, as Model Optimizer's awq_lite and awq_clip do it:

1. per input channel j of an activation x, t_j = mean|x_j|^α (normalized by √(max·min)), α on a grid from 0
   (plain round-to-nearest, so the search never does worse than RTN on its sample) to 1; the α whose
   quantized (x/t)·Q(diag(t)·W) is closest to x·W wins, one α for every MatMul that reads x (q, k and v
   share theirs);
2. per block of input rows and output column, the clipping ratio of the block's amax (1 down to 0.5) whose
   quantized block gives the smallest output error on the same activations.

Statistics stream: per activation, the running mean |x| per channel and a bounded sample of rows (at most
SAMPLE_ROWS, taken evenly from every batch), so memory grows with the layers, never with the samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from tensorsmith.passes.int4 import dequantize_int4, quantize_int4

ALPHAS = tuple(round(0.05 * i, 2) for i in range(21))
CLIP_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0 … 0.5
SAMPLE_ROWS = 256
ROWS_PER_BATCH = 32


@dataclass
class ActivationStatistics:
    """mean |x| per channel (last axis) and a bounded, evenly taken sample of rows."""

    total: np.ndarray | None = None
    count: int = 0
    rows: list[np.ndarray] = field(default_factory=list)

    def observe(self, values: np.ndarray) -> None:
        flat = np.asarray(values, np.float32).reshape(-1, values.shape[-1])
        absolute = np.abs(flat).sum(axis=0, dtype=np.float64)  # summed in float64 without a float64 copy
        self.total = absolute if self.total is None else self.total + absolute
        self.count += len(flat)
        kept = sum(len(rows) for rows in self.rows)
        if kept < SAMPLE_ROWS:
            step = max(1, len(flat) // ROWS_PER_BATCH)
            self.rows.append(flat[::step][: min(ROWS_PER_BATCH, SAMPLE_ROWS - kept)].copy())

    @property
    def mean_abs(self) -> np.ndarray:
        assert self.total is not None and self.count
        return (self.total / self.count).astype(np.float32)

    @property
    def sample(self) -> np.ndarray:
        return np.concatenate(self.rows)


def collect_statistics(batches: Iterable[Mapping[str, np.ndarray]]) -> dict[str, ActivationStatistics]:
    """One pass: every batch's observed activations ({tensor: values}) reduced at once."""
    statistics: dict[str, ActivationStatistics] = {}
    for observed in batches:
        for name, values in observed.items():
            statistics.setdefault(name, ActivationStatistics()).observe(values)
    return statistics


def _quantized_product(x: np.ndarray, weight: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    q, step = quantize_int4(weight * scale[:, None], block)
    return (x / scale) @ dequantize_int4(q, step, block)


def search_scale(statistics: ActivationStatistics, weight: np.ndarray, block: int) -> tuple[np.ndarray, float, float]:
    """(t [K], α, its error relative to RTN's) for the weights [K, N] of every MatMul reading one activation."""
    x = statistics.sample
    reference = x @ weight
    mean = np.maximum(statistics.mean_abs, 1e-6)
    best: tuple[float, np.ndarray, float] | None = None
    rtn_error = 0.0
    for alpha in ALPHAS:
        scale = mean**alpha
        scale = (scale / np.sqrt(scale.max() * scale.min())).astype(np.float32)
        error = float(np.mean((_quantized_product(x, weight, scale, block) - reference) ** 2))
        if alpha == 0.0:
            rtn_error = error
        if best is None or error < best[0]:
            best = (error, scale, alpha)
    assert best is not None
    return best[1], best[2], best[0] / rtn_error if rtn_error > 0 else 1.0


def search_clip(statistics: ActivationStatistics, weight: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """The clipping ratio [K/B, N] per block and output column of diag(t)·W that minimizes the block's output
    error on the sampled activations x/t."""
    x = statistics.sample / scale
    scaled = weight * scale[:, None]
    rows, columns = scaled.shape
    blocks = rows // block
    x_blocks = x.reshape(len(x), blocks, block)
    best_error = np.full((blocks, columns), np.inf)
    best_ratio = np.ones((blocks, columns), np.float32)
    for ratio in CLIP_RATIOS:
        clip = np.full((blocks, columns), ratio, np.float32)
        q, step = quantize_int4(scaled, block, clip)
        difference = (scaled - dequantize_int4(q, step, block)).reshape(blocks, block, columns)
        error = (np.einsum("rkb,kbn->rkn", x_blocks, difference) ** 2).sum(axis=0)  # [blocks, columns]
        better = error < best_error
        best_error = np.where(better, error, best_error)
        best_ratio = np.where(better, ratio, best_ratio)
    return best_ratio
