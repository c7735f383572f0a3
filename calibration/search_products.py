"""The matrix products AWQ's searches rank their candidates by (calibration/awq.py): in bfloat16 where the CPU
multiplies bfloat16 in hardware, else in float32.

With AVX-512 BF16 or AMX, torch's bfloat16 product (oneDNN: inputs rounded to bfloat16, sums in float32, the result
rounded to bfloat16) takes about half float32's time: Llama-3.2-1B's AWQ statistics and search went from 189 to
168 s. Without them oneDNN emulates bfloat16 and is 3x (AVX-512) to 55x (AVX2) slower than numpy's float32, and
without torch there is none: both keep float32. The rounding only moves the ranking of near ties: measured on
random layers, a product's elements move by 1.4e-3 of themselves (median), the scale search chose the same α with
its error ratio moved by 3e-4, and the clip search chose another ratio than float64 in 0.2 % of blocks, each
within 0.2 % of the best block's error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from threadpoolctl import threadpool_limits

if TYPE_CHECKING:
    import torch

Job = TypeVar("Job")
Found = TypeVar("Found")


@functools.cache
def in_bfloat16() -> bool:
    """Whether torch is here and the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX)."""
    try:
        import torch
    except ImportError:
        return False
    probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(probe() for probe in probes if probe is not None)


def operand(values: np.ndarray) -> np.ndarray | torch.Tensor:
    """`values` as the left side of products: bfloat16 where they run so, else float32 as they are."""
    if not in_bfloat16():
        return np.asarray(values, np.float32)
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16)


def products(left: np.ndarray | torch.Tensor, right: np.ndarray) -> np.ndarray:
    """left · right as float32 (left made by `operand`)."""
    if isinstance(left, np.ndarray):
        return left @ right
    import torch

    right_side = operand(right)
    assert isinstance(right_side, torch.Tensor)
    return (left @ right_side).float().numpy()


@contextmanager
def one_thread_each(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of `workers` threads whose products each run on one thread: BLAS held to one thread (a process-wide
    setting) and, for torch, each worker set to one and the process's setting put back after (torch keeps one
    count for every thread it starts, so a worker's setting would outlive the pool)."""
    if not in_bfloat16():
        with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
            yield pool
        return
    import torch

    threads = torch.get_num_threads()
    try:
        with (
            threadpool_limits(1, user_api="blas"),
            ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool,
        ):
            yield pool
    finally:
        torch.set_num_threads(threads)


def mapped(search: Callable[[Job], Found], jobs: Iterable[Job], workers: int) -> list[Found]:
    """`search` over `jobs` on `workers` threads (one_thread_each), results in the jobs' order."""
    with one_thread_each(workers) as pool:
        return list(pool.map(search, jobs))
