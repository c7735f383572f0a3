"""AWQ's search products (calibration/search_products.py): float32 where bfloat16 is not done in hardware, bfloat16
close to float32 where it is, and a pool of one-thread workers that leaves torch's thread count as it found it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tensorsmith.calibration import awq, search_products
from tests.calibration.test_awq import BLOCK, statistics, weight


@pytest.fixture
def float32_products(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As on a CPU without AVX-512 BF16 or AMX, or without torch."""
    monkeypatch.setattr(search_products, "in_bfloat16", lambda: False)
    yield


def test_without_bfloat16_hardware_the_products_are_numpys_float32(float32_products: None) -> None:
    rng = np.random.default_rng(0)
    left, right = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal((64, 5)).astype(np.float32)
    made = search_products.operand(left)
    assert isinstance(made, np.ndarray)
    np.testing.assert_array_equal(search_products.products(made, right), left @ right)


def test_bfloat16_products_stay_within_bfloat16s_rounding_of_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search_products, "in_bfloat16", lambda: True)  # emulated where the CPU has no bfloat16
    rng = np.random.default_rng(0)
    left, right = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((512, 64)).astype(np.float32)
    exact = left.astype(np.float64) @ right
    made = search_products.products(search_products.operand(left), right)
    assert made.dtype == np.float32
    assert np.median(np.abs(made - exact) / np.abs(exact).mean()) < 1e-2  # 8 bits of mantissa, not 24


def test_the_searches_choose_alike_in_float32_and_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 forced where the CPU would not take it (emulated: slower, the same rounding)."""
    observed, w = statistics(64, 128), weight(128, 64)
    monkeypatch.setattr(search_products, "in_bfloat16", lambda: True)
    chosen = awq.search_scale(observed, [w], BLOCK)
    clips = awq.search_clip(observed, w, chosen[0], BLOCK)
    monkeypatch.setattr(search_products, "in_bfloat16", lambda: False)
    in_float32 = awq.search_scale(observed, [w], BLOCK)
    assert chosen[1] == in_float32[1] and chosen[2] == pytest.approx(in_float32[2], rel=1e-2)
    assert np.mean(clips == awq.search_clip(observed, w, chosen[0], BLOCK)) > 0.98


@pytest.mark.parametrize("bfloat16", [True, False])
def test_the_pool_leaves_torchs_thread_count_as_it_found_it(monkeypatch: pytest.MonkeyPatch, bfloat16: bool) -> None:
    monkeypatch.setattr(search_products, "in_bfloat16", lambda: bfloat16)
    before = torch.get_num_threads()
    threads_seen = search_products.mapped(lambda _: torch.get_num_threads(), range(4), workers=2)
    assert threads_seen == [1 if bfloat16 else before] * 4
    seen: list[int] = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert torch.get_num_threads() == before and seen == [before]
