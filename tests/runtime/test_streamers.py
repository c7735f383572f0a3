"""transformers' streamers over generate(), as transformers drives them; and a decoder is not a Triton model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensorsmith.runtime import InputError, load
from tests.conftest import run_cli


def test_text_streamer_skipping_the_prompt_prints_every_new_token(
    tinylm_cpu_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import PreTrainedTokenizerFast, TextStreamer

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tinylm_cpu_artifact / "tokenizer" / "tokenizer.json"))
    prompt = np.array(tokenizer("The with statement")["input_ids"])
    with load(tinylm_cpu_artifact) as model:
        capsys.readouterr()
        sequences = model.generate(prompt, max_new_tokens=20, streamer=TextStreamer(tokenizer, skip_prompt=True))
        with pytest.raises(InputError, match="cannot follow beam search"):
            model.generate(prompt, max_new_tokens=4, num_beams=2, streamer=TextStreamer(tokenizer))
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == tokenizer.decode(sequences[0, len(prompt) :]).rstrip("\n")


def test_a_decoders_triton_export_is_refused_naming_serve(tinylm_cpu_artifact: Path, tmp_path: Path) -> None:
    result = run_cli("export-triton", str(tinylm_cpu_artifact), "--target", "cpu", "-o", str(tmp_path / "repo"))
    assert result.exit_code == 1 and "is a decoder" in result.stderr and "tensorsmith serve" in result.stderr
    assert not (tmp_path / "repo").exists()
