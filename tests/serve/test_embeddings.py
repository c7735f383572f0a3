"""`/v1/embeddings` over an encoder artifact (the real all-MiniLM-L6-v2), with OpenAI's client: the vectors are
the artifact's own `sentence_embedding` for each text, whatever else shares its model call."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from tensorsmith.runtime import load
from tests.conftest import SAMPLES, compiled_once, run_cli_json
from tests.serve.server import serving

TEXTS = ["The with statement", "Exceptions are raised when an error is detected during execution.", "x" * 40]


@pytest.fixture(scope="module")
def minilm_cpu_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tensorsmith.samples import prepare

    prepare.prepare("minilm")
    config = SAMPLES / "minilm" / "tensorsmith.toml"
    return compiled_once(tmp_path_factory, "minilm-cpu", lambda out: run_cli_json("compile", config, "-o", out,
                                                                                  "--target", "cpu"))  # fmt: skip


@pytest.mark.slow
def test_embeddings_are_the_models_sentence_embeddings(minilm_cpu_artifact: Path) -> None:
    from tensorsmith.samples.minilm.model import model_directory

    tokenizer_dir = model_directory()
    with serving(minilm_cpu_artifact, "--tokenizer", str(tokenizer_dir), "--served-model-name", "minilm") as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
        with ThreadPoolExecutor(8) as pool:  # concurrent requests share model calls (the DynamicBatcher)
            replies = list(pool.map(lambda text: client.embeddings.create(model="minilm", input=text), TEXTS * 4))
        batch = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
        with pytest.raises(openai.BadRequestError, match="is an encoder: it serves /v1/embeddings"):
            client.completions.create(model="minilm", prompt="x")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    with load(minilm_cpu_artifact, backend="onnxruntime") as model:
        expected = []
        for text in TEXTS:
            ids = np.array([tokenizer.encode(text).ids])
            expected.append(model.run({"input_ids": ids, "attention_mask": np.ones_like(ids)})["sentence_embedding"][0])
    for index, reply in enumerate(replies):
        vector = np.array(reply.data[0].embedding)
        assert np.allclose(vector, expected[index % len(TEXTS)], atol=1e-4)
    assert [item.index for item in batch.data] == [0, 1, 2]
    assert np.allclose(np.array([item.embedding for item in batch.data]), np.stack(expected), atol=1e-4)
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(text).ids) for text in TEXTS)
