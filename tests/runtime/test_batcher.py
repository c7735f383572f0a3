"""DynamicBatcher on a real compiled model (the tiny BERT sample on ONNX Runtime): concurrent requests of
mixed batch sizes and sequence lengths get exactly their own outputs, in fewer model calls."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np
import pytest

from tensorsmith.runtime import DynamicBatcher, Model, load
from tensorsmith.samples import prepare
from tests.conftest import run_cli_json

SAMPLE = prepare.SAMPLES / "tiny_bert" / "tensorsmith.toml"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    prepare.prepare("tiny_bert")
    out = tmp_path_factory.mktemp("batcher") / "tiny_bert"
    run_cli_json("compile", SAMPLE, "-o", out)
    return load(out)


class Counting:
    """The model, with every call's batch size recorded."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.inputs = model.inputs
        self.max_batch = model.max_batch
        self.batches: list[int] = []

    def run(self, feeds: Mapping[str, object]) -> dict[str, np.ndarray]:
        self.batches.append(len(feeds["input_ids"]))  # type: ignore[arg-type]
        return self.model.run(feeds)


def request(rng: np.random.Generator, rows: int, sequence: int) -> dict[str, np.ndarray]:
    mask = np.ones((rows, sequence), np.int64)
    mask[:, sequence - rng.integers(0, sequence // 2) :] = 0  # padded tails of different lengths
    return {"input_ids": rng.integers(0, 1000, (rows, sequence)), "attention_mask": mask}


def test_64_concurrent_requests_of_mixed_sizes_get_their_own_outputs(model: Model) -> None:
    rng = np.random.default_rng(3)
    requests = [request(rng, int(rng.integers(1, 6)), int(rng.choice([8, 16]))) for _ in range(64)]
    expected = [model.run(feeds) for feeds in requests]
    counting = Counting(model)
    batcher = DynamicBatcher(counting, max_batch=32, max_delay_ms=15)

    async def all_at_once() -> list[dict[str, np.ndarray]]:
        return await asyncio.gather(*(batcher.run(feeds) for feeds in requests))

    results = asyncio.run(all_at_once())
    for index, (result, reference) in enumerate(zip(results, expected, strict=True)):
        assert result.keys() == reference.keys()
        for name in reference:
            assert result[name].shape == reference[name].shape, (index, name)
            np.testing.assert_allclose(result[name], reference[name], rtol=1e-4, atol=1e-5, err_msg=f"{index}")
    assert sum(counting.batches) == sum(len(feeds["input_ids"]) for feeds in requests)
    assert len(counting.batches) < 64 / 4 and max(counting.batches) <= 32  # batched, never past max_batch
    assert batcher.stats.requests == 64 and batcher.stats.model_calls == len(counting.batches)


def test_max_batch_is_capped_by_the_models_limit(model: Model) -> None:
    assert model.max_batch == 64  # the sample's [dims.batch] max
    assert DynamicBatcher(model, max_batch=1000).max_batch == 64


def test_a_request_larger_than_max_batch_is_split_across_calls(model: Model) -> None:
    feeds = request(np.random.default_rng(0), 10, 8)
    counting = Counting(model)
    batcher = DynamicBatcher(counting, max_batch=4, max_delay_ms=1)
    result = asyncio.run(batcher.run(feeds))
    assert counting.batches == [4, 4, 2]
    np.testing.assert_allclose(result["hidden_states"], model.run(feeds)["hidden_states"], rtol=1e-4, atol=1e-5)


def test_a_lone_request_goes_after_the_delay(model: Model) -> None:
    batcher = DynamicBatcher(model, max_batch=32, max_delay_ms=5)
    result = asyncio.run(batcher.run(request(np.random.default_rng(1), 2, 8)))
    assert result["hidden_states"].shape == (2, 8, 64) and batcher.stats.model_calls == 1


def test_feeds_that_cannot_be_batched_are_refused(model: Model) -> None:
    batcher = DynamicBatcher(model)
    ids = np.zeros((2, 8), np.int64)
    with pytest.raises(ValueError, match="missing \\['attention_mask'\\]"):
        asyncio.run(batcher.run({"input_ids": ids}))
    with pytest.raises(ValueError, match="same batch"):
        asyncio.run(batcher.run({"input_ids": ids, "attention_mask": ids[:1]}))


def test_a_model_error_reaches_every_request_of_its_batch(model: Model) -> None:
    batcher = DynamicBatcher(model, max_batch=8, max_delay_ms=20)
    good = request(np.random.default_rng(2), 1, 8)
    bad = {"input_ids": good["input_ids"].astype(np.int32), "attention_mask": good["attention_mask"]}

    async def together() -> list[object]:
        return await asyncio.gather(batcher.run(bad), batcher.run(bad), return_exceptions=True)

    errors = asyncio.run(together())
    assert all(isinstance(error, ValueError) and "input_ids" in str(error) for error in errors)


def test_one_batcher_serves_successive_event_loops(model: Model) -> None:
    batcher = DynamicBatcher(model, max_batch=8, max_delay_ms=2)
    feeds = request(np.random.default_rng(4), 2, 8)
    for _ in range(2):  # asyncio.run makes a new loop each time
        result = asyncio.run(batcher.run(feeds))
        np.testing.assert_allclose(result["hidden_states"], model.run(feeds)["hidden_states"], rtol=1e-4, atol=1e-5)
    assert batcher.stats.model_calls == 2
