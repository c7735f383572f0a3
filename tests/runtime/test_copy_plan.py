"""runtime/copy_plan.py: what a generation step copies between host and device, by hand-computed figures."""

from __future__ import annotations

import numpy as np
import pytest

from tensorsmith.runtime.copy_plan import (
    LOGITS,
    MASK,
    NEXT_TOKENS,
    Direction,
    Pitched,
    Transfer,
    device_buffers,
    dynamic_step_copies,
    staging_bytes,
    step_copies,
)
from tensorsmith.runtime.kv_cache import WRITE_INDICES, CacheShape, present_of
from tensorsmith.runtime.manifest import GenerationRecord

# Llama-3.2-1B's cache (bench/shapes.py): 16 layers, 8 kv heads, head_dim 64; its vocabulary 128,256
LLAMA_1B = GenerationRecord(layers=16, kv_heads=8, head_dim=64, max_sequence_length=2048)
LLAMA_VOCABULARY = 128_256


def llama(rows: int = 1, capacity: int = 2048, dtype: str = "float32") -> CacheShape:
    return CacheShape(LLAMA_1B, rows, capacity, np.dtype(dtype))


@pytest.mark.parametrize("rows", [1, 8])
def test_a_static_decode_step_copies_the_same_bytes_whatever_the_capacity(rows: int) -> None:
    plans = [step_copies(llama(rows, capacity), 1, LLAMA_VOCABULARY, "float32") for capacity in (16, 128, 2048, 8192)]
    assert {plan.by_tensor()[MASK] for plan in plans} == {rows * 8}
    assert len({(plan.bytes_to_device, plan.bytes_to_host) for plan in plans}) == 1


def test_a_dynamic_decode_step_copies_more_the_longer_the_past() -> None:
    shape = llama()
    totals = [dynamic_step_copies(shape, past, 1, LLAMA_VOCABULARY, "float32").total_bytes for past in (1, 128, 2047)]
    assert totals == sorted(totals) and len(set(totals)) == 3
    # each token of past adds a key and a value row per layer, each way, and a mask column in
    step = 16 * 2 * 8 * 64 * 4
    assert totals[1] - totals[0] == 127 * (2 * step + 8)


def test_the_dynamic_cache_moves_the_issues_134_mb_each_way_at_2048_tokens() -> None:
    """Issue 25: 16 layers × 2 × 8 heads × 64 × 2,048 × 4 B = 134 MB each way, ~5 ms at 25 GB/s."""
    plan = dynamic_step_copies(llama(), 2048, 1, LLAMA_VOCABULARY, "float32")
    pasts = sum(t.nbytes for t in plan.to_device if t.tensor.startswith("past_key_values."))
    presents = sum(t.nbytes for t in plan.to_host if t.tensor.startswith("present."))
    assert pasts == 16 * 2 * 8 * 64 * 2048 * 4 == 134_217_728
    assert int(pasts / 1e6) == int(presents / 1e6) == int(plan.bytes_to_device / 1e6) == 134
    assert 5.0 < pasts / 25e9 * 1e3 < 6.0  # milliseconds at 25 GB/s


def test_llama_1b_decode_and_prefill_on_the_static_cache_by_hand() -> None:
    shape = llama()
    decode = step_copies(shape, 1, LLAMA_VOCABULARY, "float32")
    # input_ids, position_ids, write_indices, one mask column: 8 B each; the last position's fp32 logits back
    assert decode.bytes_to_device == 32 and decode.bytes_to_host == LLAMA_VOCABULARY * 4 == 513_024
    prefill = step_copies(shape, 128, LLAMA_VOCABULARY, "float32")
    assert prefill.bytes_to_device == 3 * 128 * 8 + 8 and prefill.bytes_to_host == 513_024
    # against the dynamic prefill: every position's logits come back
    dynamic = dynamic_step_copies(shape, 0, 128, LLAMA_VOCABULARY, "float32")
    assert dynamic.by_tensor()[LOGITS] == 128 * LLAMA_VOCABULARY * 4
    # fp16 logits halve what comes back; greedy argmax on the device brings the token ids only
    assert step_copies(shape, 1, LLAMA_VOCABULARY, "float16").bytes_to_host == LLAMA_VOCABULARY * 2
    greedy = step_copies(llama(8), 1, LLAMA_VOCABULARY, "float32", greedy_on_device=True)
    assert greedy.bytes_to_host == 8 * 8 and greedy.to_host[0].tensor == NEXT_TOKENS


def test_batch_8_decode_step_by_hand() -> None:
    plan = step_copies(llama(8), 1, LLAMA_VOCABULARY, "float16")
    assert plan.by_tensor() == {"input_ids": 64, "position_ids": 64, WRITE_INDICES: 64, MASK: 64,
                                LOGITS: 8 * LLAMA_VOCABULARY * 2}  # fmt: skip
    assert [t.direction for t in plan.transfers] == [Direction.TO_DEVICE] * 4 + [Direction.TO_HOST]


def test_the_plan_agrees_with_the_cache_shape() -> None:
    shape = llama(4, 1024, "float16")
    buffers = device_buffers(shape, LLAMA_VOCABULARY, "float16")
    assert {name: buffers[name] for name in shape.reserved_bytes} == shape.reserved_bytes
    assert not any(name.startswith("present.") for name in buffers)  # a present shares its past's buffer
    mask = next(t for t in step_copies(shape, 1, LLAMA_VOCABULARY, "float16").transfers if t.tensor == MASK)
    assert mask.device_pitch is not None and mask.device_pitch * mask.rows == shape.reserved_bytes[MASK]
    dynamic = dynamic_step_copies(shape, shape.capacity, 0, LLAMA_VOCABULARY, "float16").by_tensor()
    assert all(dynamic[name] == dynamic[present_of(name)] == shape.tensor_bytes(name) for name in shape.pasts)
    # the step buffers at their largest: a step as long as the cache
    assert buffers["input_ids"] == 4 * 1024 * 8 and buffers[LOGITS] == 4 * LLAMA_VOCABULARY * 2
    staged = staging_bytes(shape, LLAMA_VOCABULARY, "float16")
    assert staged == {"input_ids": 4 * 1024 * 8, "position_ids": 4 * 1024 * 8, WRITE_INDICES: 32,
                      MASK: 4 * 1024 * 8, LOGITS: 4 * LLAMA_VOCABULARY * 2}  # fmt: skip


def test_the_mask_columns_land_at_the_write_index() -> None:
    transfer = Transfer(MASK, Direction.TO_DEVICE, rows=3, row_bytes=2 * 8, device_pitch=10 * 8, column_bytes=8)
    assert transfer.pitched and transfer.nbytes == 48
    assert transfer.layout(5) == Pitched(device_offset=40, device_pitch=80, host_pitch=16, width=16, height=3)
    with pytest.raises(ValueError, match="overrun"):
        transfer.layout(9)  # slots 9 and 10 of a row of 10


def test_a_pitched_copy_by_its_arguments_writes_what_the_host_session_writes() -> None:
    """cudaMemcpy2D by its arguments, in numpy: the device mask ends as StaticCacheSession's host mask."""
    rows, capacity, new, write_index = 3, 10, 4, 2
    shape = CacheShape(LLAMA_1B, rows, capacity, np.dtype("float32"))
    transfer = next(t for t in step_copies(shape, new, 7, "float32").transfers if t.tensor == MASK)
    layout = transfer.layout(write_index)
    new_mask = np.arange(1, rows * new + 1, dtype=np.int64).reshape(rows, new)
    device, host = np.zeros(rows * capacity * 8, np.uint8), new_mask.reshape(-1).view(np.uint8)
    for row in range(layout.height):
        start = layout.device_offset + row * layout.device_pitch
        device[start : start + layout.width] = host[row * layout.host_pitch : row * layout.host_pitch + layout.width]
    expected = np.zeros((rows, capacity), np.int64)
    expected[:, write_index : write_index + new] = new_mask
    np.testing.assert_array_equal(device.view(np.int64).reshape(rows, capacity), expected)


def test_contiguous_transfers_are_one_plain_copy() -> None:
    transfer = step_copies(llama(2), 3, 11, "float32").transfers[0]
    assert not transfer.pitched and transfer.layout(7) == Pitched(0, 24, 24, 24, 2)  # rows of 3 ids


@pytest.mark.parametrize("new_tokens", [0, 2049])
def test_a_step_that_does_not_fit_the_cache_has_no_plan(new_tokens: int) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        step_copies(llama(), new_tokens, LLAMA_VOCABULARY, "float32")
