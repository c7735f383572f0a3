"""`Model.generate` refuses bad settings and token ids with an InputError (a ValueError) naming them, with a hint,
before anything runs: on the session's tinylm artifact (vocabulary 2048, 512 positions) on ONNX Runtime."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorsmith.runtime import InputError, Model, load

PROMPT = np.array([[1, 2, 3]], np.int64)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "negative max_new_tokens": ({"max_new_tokens": -5}, "max_new_tokens is -5"),
    "zero beams": ({"num_beams": 0}, "num_beams is 0"),
    "top_p above 1": ({"top_p": 2.0}, "top_p is 2.0"),
    "negative top_k": ({"top_k": -1}, "top_k is -1"),
    "sampling at temperature 0": ({"do_sample": True, "temperature": 0.0}, "temperature is 0.0"),
    "nan temperature": ({"temperature": float("nan")}, "temperature is nan"),
    "negative seed": ({"do_sample": True, "seed": -1}, "seed is -1"),
    "sampling beams": ({"do_sample": True, "num_beams": 2}, "beam sampling is not supported"),
    "id above the vocabulary": ({"input_ids": np.array([[1, 99999]])}, r"input_ids\[0, 1\] is 99999, outside"),
    "negative padding id": ({"input_ids": np.array([[-1, 4], [3, 4]])}, r"input_ids\[0, 0\] is -1"),
    "float ids": ({"input_ids": np.array([[1.0, 2.0]])}, "input_ids are float64"),
    "empty prompt": ({"input_ids": np.zeros((1, 0), np.int64)}, r"input_ids have shape \(1, 0\)"),
    "mask of another shape": ({"attention_mask": np.ones((1, 2), np.int64)}, "attention_mask has shape"),
    "pad outside the vocabulary": ({"pad_token_id": 2048}, "pad_token_id 2048 is outside the vocabulary"),
    "past the max sequence length": ({"max_new_tokens": 510}, "leaves room for 509 new tokens, not 510"),
}


@pytest.fixture(scope="module")
def model(tinylm_cpu_artifact: Path) -> Iterator[Model]:
    with load(tinylm_cpu_artifact, backend="onnxruntime") as loaded:
        yield loaded


@pytest.mark.parametrize("case", BAD)
def test_a_bad_generate_argument_is_refused_before_anything_runs(
    case: str, model: Model, capfd: pytest.CaptureFixture[str]
) -> None:
    arguments, expected = BAD[case]
    streamed: list[np.ndarray] = []
    with pytest.raises(InputError, match=expected) as raised:
        model.generate(**{"input_ids": PROMPT, **arguments}, streamer=streamed.append)
    assert isinstance(raised.value, ValueError) and raised.value.hint
    # nothing ran: no token streamed, and no ONNX Runtime error logged on the way (its red line on stderr)
    assert not streamed and "onnxruntime" not in capfd.readouterr().err


def test_good_arguments_still_generate(model: Model) -> None:
    sequences = model.generate(PROMPT, max_new_tokens=4, do_sample=True, top_k=5, top_p=0.9, seed=0, eos_token_id=[])
    assert sequences.shape == (1, 7) and ((sequences >= 0) & (sequences < 2048)).all()
    assert model.generate(PROMPT[0], max_new_tokens=2, num_beams=2).shape == (1, 5)  # one prompt as 1-D
    numpy_scalars = {"max_new_tokens": np.int64(2), "temperature": np.float32(0.7), "top_p": np.float32(0.9)}
    assert model.generate(PROMPT, do_sample=True, seed=0, **numpy_scalars).shape[1] <= 5
