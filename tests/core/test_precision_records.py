"""The precision records carry the numbers the code computes with: the bytes a weight takes in each, from its
element, block and scales, as the weight search and the size estimates read them."""

import pytest

from tensorsmith.core.precisions import FP8, FP16, FP32, INT4, INT8, INT8_WEIGHT, NVFP4, Element, decoder_levels

K, N = 4096, 1024


@pytest.mark.parametrize(
    ("record", "block", "expected"),
    [
        (FP16, None, 2 * K * N),  # a float: its values only
        (FP32, None, 4 * K * N),
        (INT8_WEIGHT, None, K * N + 2 * N),  # a byte a weight, an fp16 scale a column
        (INT8, None, K * N + 2 * N),
        (FP8, None, K * N + 2 * N),
        (INT4, None, K * N // 2 + 2 * (K // 128) * N),  # half a byte, an fp16 scale per 128 of K and column
        (INT4, 32, K * N // 2 + 2 * (K // 32) * N),  # the compile's block
        (NVFP4, 32, K * N // 2 + (K // 16) * N + 4),  # its own block of 16, fp8 scales, one fp32 tensor scale
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_the_bytes_a_weight_takes_come_from_the_record(record, block, expected) -> None:  # type: ignore[no-untyped-def]
    assert record.stored_bytes(K, N, Element.FP16, block) == expected


def test_every_decoder_level_says_its_bytes_and_fewer_bits_store_less() -> None:
    sizes = {record.name: record.stored_bytes(K, N, Element.FP16, 128) for record in decoder_levels()}
    assert sizes[INT4.name] < sizes[INT8_WEIGHT.name] < FP16.stored_bytes(K, N, Element.FP16)
    assert INT8_WEIGHT.stored_bytes(K, N, Element.FP32) == K * N + 4 * N  # the cpu variant's fp32 scales


def test_an_element_says_its_range_rounding_and_dtype() -> None:
    """What quantize_weights asks instead of branching on names: int8 rounds into ±127, float8 e4m3 saturates at
    ±448 in ml_dtypes' float8_e4m3fn."""
    import ml_dtypes
    import numpy as np

    assert (Element.INT8.maximum, Element.INT8.is_integer, Element.INT8.numpy_dtype()) == (127.0, True, np.int8)
    assert (Element.FP8_E4M3.maximum, Element.FP8_E4M3.is_integer) == (448.0, False)
    assert Element.FP8_E4M3.numpy_dtype() == np.dtype(ml_dtypes.float8_e4m3fn)
    assert float(np.array(Element.FP8_E4M3.maximum).astype(ml_dtypes.float8_e4m3fn)) == 448.0  # finite, the largest
