import numpy as np
import pytest

from tensorsmith.runtime.specs import TensorSpec, check_feeds

SPECS = [
    TensorSpec("input_ids", "int64", ("batch", "sequence")),
    TensorSpec("pixels", "float32", ("batch", 3, 4)),
]


def feeds(batch: int = 2, sequence: int = 5) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.zeros((batch, sequence), np.int64),
        "pixels": np.zeros((batch, 3, 4), np.float32),
    }


def test_valid_feeds_pass_through_unchanged() -> None:
    given = feeds()
    checked = check_feeds(given, SPECS)
    assert checked.keys() == given.keys()
    assert checked["pixels"] is given["pixels"]


def test_lists_become_arrays() -> None:
    checked = check_feeds({"x": [[1.0, 2.0]]}, [TensorSpec("x", "float64", ("batch", 2))])
    assert checked["x"].shape == (1, 2)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.pop("pixels"), r"missing input\(s\) \['pixels'\]"),
        (lambda f: f.update(extra=np.zeros(1)), r"unexpected input\(s\) \['extra'\]"),
        (lambda f: f.update(input_ids=np.zeros((2, 5), np.int32)), r"'input_ids' has dtype int32.*input_ids:int64"),
        (lambda f: f.update(pixels=np.zeros((2, 3), np.float32)), r"'pixels' has rank 2.*pixels:float32:\[batch,3,4\]"),
        (lambda f: f.update(pixels=np.zeros((2, 3, 5), np.float32)), r"'pixels' has size 5 on axis 2, expected 4"),
        (lambda f: f.update(pixels=np.zeros((3, 3, 4), np.float32)), r"'pixels' has size 3 on axis 0 \('batch'\)"),
    ],
)
def test_bad_feeds_name_the_input_and_the_spec(mutate, message) -> None:  # type: ignore[no-untyped-def]
    given = feeds()
    mutate(given)
    with pytest.raises(ValueError, match=message):
        check_feeds(given, SPECS)
