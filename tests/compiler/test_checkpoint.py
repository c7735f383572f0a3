import pickle
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tensorsmith.compiler.frontend.checkpoint import load_checkpoint
from tensorsmith.core.errors import ExportError


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_safetensors_and_weights_only_pt_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = model()
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": source.state_dict(), "epoch": 3}, tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        target = model()
        load_checkpoint(target, tmp_path / name)
        torch.testing.assert_close(target[0].weight, source[0].weight)


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path: Path) -> None:
    state = model().state_dict()
    state.pop("2.bias")
    state["3.weight"] = torch.zeros(1)
    state["0.weight"] = torch.zeros(5, 4)
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(ExportError) as caught:
        load_checkpoint(model(), tmp_path / "w.safetensors")
    message = str(caught.value)
    assert "missing keys: 2.bias" in message
    assert "unexpected keys: 3.weight" in message
    assert "0.weight (5, 4) vs (3, 4)" in message


class Payload:
    """Unpickling this would run code; a weights-only load must refuse it."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("arbitrary code ran",))


def test_a_pickle_with_arbitrary_objects_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.pt"
    with path.open("wb") as stream:
        pickle.dump({"0.weight": Payload()}, stream)
    with pytest.raises(ExportError, match="refuses to unpickle") as caught, warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own warning about the pickle protocol is not passed on either
        load_checkpoint(model(), path)
    assert caught.value.hint and "safetensors" in caught.value.hint and "state_dict" in caught.value.hint
    # A security refusal never relays torch's advice on how to get around it.
    assert "weights_only=False" not in str(caught.value) and "False" not in str(caught.value.hint)
    assert "arbitrary code ran" not in capsys.readouterr().out


def test_a_whole_pickled_module_is_refused(tmp_path: Path) -> None:
    torch.save(model(), tmp_path / "module.pt")
    with pytest.raises(ExportError, match="refuses to unpickle"):
        load_checkpoint(model(), tmp_path / "module.pt")


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="does not exist"):
        load_checkpoint(model(), tmp_path / "none.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ExportError, match="not a valid safetensors file"):
        load_checkpoint(model(), tmp_path / "bad.safetensors")
