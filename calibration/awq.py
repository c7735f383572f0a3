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

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from tensorsmith.calibration.search_products import mapped, operand, products
from tensorsmith.passes.int4 import block_amax, block_step
from tensorsmith.passes.int4_codes import INT4_MAX, INT4_MIN

ALPHAS = tuple(round(0.1 * i, 1) for i in range(11))  # Model Optimizer awq_lite's grid (alpha_step 0.1)
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


# output columns searched at once: bounded temporaries at any N, and chunks enough to share among the cores
# (Llama-3.2-1B's layer on two: 3.9 s with 512, 5.4 s with 2048; 6.2 s one chunk of 2048 after another)
COLUMNS_PER_CHUNK = 512
# chunks searched side by side: numpy's elementwise work runs on the calling thread alone, so one thread a core
# (at most 4: each holds a chunk's temporaries, 90 MB at Llama-3.1-8B's down projection)
WORKERS = max(1, min(4, os.cpu_count() or 1))
Found = TypeVar("Found")


def _column_chunks(weights: Sequence[np.ndarray]) -> list[tuple[np.ndarray, slice]]:
    """Every weight's output columns in chunks, the weights in order (never joined: a copy of an 8B output
    projection's 2.1 GB)."""
    return [
        (weight, slice(start, min(start + COLUMNS_PER_CHUNK, weight.shape[1])))
        for weight in weights
        for start in range(0, weight.shape[1], COLUMNS_PER_CHUNK)
    ]


def _over_chunks(search: Callable[[np.ndarray, slice], Found], weights: Sequence[np.ndarray]) -> list[Found]:
    """`search(weight, chunk)` for every chunk of output columns, in their order, on WORKERS threads, each of whose
    products runs on one thread (calibration/search_products.py): BLAS's or torch's own threads beside these would
    contend for the same cores (two scale searches on two cores: 3.5 s so, 1.9 s with one BLAS thread, against
    2.9 s one after the other)."""
    return mapped(lambda job: search(*job), _column_chunks(weights), WORKERS)


def _rounding_error(blocks: np.ndarray, step: np.ndarray) -> np.ndarray:
    """blocks − dequantize(quantize(blocks)) for blocks [K/B, B, n] and their steps [K/B, 1, n] (clip·amax/7.5),
    in place on one temporary: what quantize_int4 then dequantize_int4 compute, without their copies."""
    error = np.divide(blocks, step)
    np.round(error, out=error)
    np.clip(error, INT4_MIN, INT4_MAX, out=error)
    error *= step
    np.subtract(blocks, error, out=error)
    return error


def _steps(amax: np.ndarray, ratio: float = 1.0) -> np.ndarray:
    """quantize_int4's step per block and column, [K/B, 1, n], from the block amax [K/B, n]."""
    return block_step(amax * np.float32(ratio))[:, None, :]


def search_scale(
    statistics: ActivationStatistics, weights: Sequence[np.ndarray], block: int
) -> tuple[np.ndarray, float, float]:
    """(t [K], α, its error relative to RTN's) for the weights [K, N] of every MatMul reading one activation (q, k
    and v share theirs), searched side by side.

    The error of α is ‖x·E‖² with E = Q(diag(t)·W)/t − W, the quantized product's difference from x·W."""
    x = operand(statistics.sample)
    rows, columns = weights[0].shape[0], sum(weight.shape[1] for weight in weights)
    mean = np.maximum(statistics.mean_abs, 1e-6)
    scales = []
    for alpha in ALPHAS:
        scale = mean**alpha
        scales.append((scale / np.sqrt(scale.max() * scale.min())).astype(np.float32))

    def chunk_errors(weight: np.ndarray, columns_chunk: slice) -> np.ndarray:
        chunk = weight[:, columns_chunk]
        errors = np.zeros(len(ALPHAS))
        for index, scale in enumerate(scales):
            blocks = (chunk * scale[:, None]).reshape(rows // block, block, -1)
            difference = _rounding_error(blocks, _steps(block_amax(blocks.reshape(rows, -1), block)))
            difference = difference.reshape(rows, -1)
            difference /= scale[:, None]
            errors[index] = float(np.square(products(x, difference)).sum(dtype=np.float64))
        return errors

    errors = np.sum(_over_chunks(chunk_errors, weights), axis=0)  # summed in chunk order: the same at any WORKERS
    errors /= x.shape[0] * columns
    best = int(np.argmin(errors))
    rtn_error = errors[ALPHAS.index(0.0)]
    return scales[best], ALPHAS[best], float(errors[best] / rtn_error) if rtn_error > 0 else 1.0


def search_clip(statistics: ActivationStatistics, weight: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """The clipping ratio [K/B, N] per block and output column of diag(t)·W that minimizes the block's output
    error on the sampled activations x/t.

    A block's error over the sample rows is dᵀ·G·d, with d its column's rounding error and G = xᵀx the Gram matrix
    of the block's input channels [B, B]: one small matrix product per block instead of one per sample row."""
    x = statistics.sample / scale
    rows, columns = weight.shape
    blocks_count = rows // block
    x_blocks = x.reshape(len(x), blocks_count, block).transpose(1, 0, 2)  # [K/B, rows, B]
    gram = operand(np.matmul(x_blocks.transpose(0, 2, 1), x_blocks))  # [K/B, B, B]
    best_ratio = np.ones((blocks_count, columns), np.float32)

    def choose(weight: np.ndarray, columns_chunk: slice) -> None:
        blocks = (weight[:, columns_chunk] * scale[:, None]).reshape(blocks_count, block, -1)
        amax = block_amax(blocks.reshape(rows, -1), block)
        best_error = np.full(amax.shape, np.inf, np.float32)
        chosen = best_ratio[:, columns_chunk]  # a view: each chunk writes its own columns
        for ratio in CLIP_RATIOS:
            difference = _rounding_error(blocks, _steps(amax, ratio))
            error = np.einsum("kbn,kbn->kn", difference, products(gram, difference))  # [K/B, n]
            better = error < best_error
            best_error[better] = error[better]
            chosen[better] = ratio

    _over_chunks(choose, [weight])
    return best_ratio
