"""`/v1/embeddings` for an encoder artifact: texts tokenized, run through the runtime's `DynamicBatcher` (so
concurrent requests share model calls), one vector per text.

The vector is the model's own pooled output where it has one (a 2-D output such as sentence-transformers'
`sentence_embedding`), else the mean of the first per-token output over the real tokens (sentence-transformers'
default pooling). Texts are padded to a multiple of `BUCKET` tokens so that requests of near lengths batch.
"""

from __future__ import annotations

import numpy as np

from tensorsmith.runtime.batcher import DynamicBatcher
from tensorsmith.runtime.errors import InferenceError, InputError
from tensorsmith.runtime.loader import Model
from tensorsmith.serve.errors import OpenAIError
from tensorsmith.serve.text import TextCodec

BUCKET = 16


class Embedder:
    def __init__(self, model: Model, codec: TextCodec) -> None:
        self._model = model
        self._codec = codec
        self._batcher = DynamicBatcher(model, max_batch=32, max_delay_ms=5)
        names = [spec.name for spec in model.inputs]
        if "input_ids" not in names:
            raise InputError(
                f"{model.directory} takes no input_ids: it is no text encoder", hint="serve a text model's artifact"
            )
        self._takes_mask = "attention_mask" in names
        pooled = [spec.name for spec in model.outputs if len(spec.shape) == 2]
        self._output = pooled[0] if pooled else model.outputs[0].name
        self._pooled = bool(pooled)
        limits = model.manifest.dims.get(str(model.inputs[names.index("input_ids")].shape[1]), {})
        self.max_tokens = limits.get("max") or 512

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """One vector per text [texts, width] (float32), and the tokens read."""
        ids = [self._codec.encode(text) for text in texts]
        for index, row in enumerate(ids):
            if len(row) > self.max_tokens:
                raise OpenAIError(
                    400,
                    f"input[{index}] is {len(row)} tokens; this model reads at most {self.max_tokens}",
                    param="input",
                    hint="split the text",
                )
        length = -(-max(len(row) for row in ids) // BUCKET) * BUCKET
        tokens = np.zeros((len(ids), min(length, self.max_tokens)), np.int64)
        mask = np.zeros_like(tokens)
        for index, row in enumerate(ids):
            tokens[index, : len(row)], mask[index, : len(row)] = row, 1
        feeds = {"input_ids": tokens, **({"attention_mask": mask} if self._takes_mask else {})}
        try:
            outputs = await self._batcher.run(feeds)
        except InferenceError as err:
            raise OpenAIError(500, f"the model failed: {err.message}") from err
        values = outputs[self._output].astype(np.float32)
        if not self._pooled:
            weights = mask[:, :, None].astype(np.float32)
            values = (values * weights).sum(1) / np.maximum(weights.sum(1), 1)
        return values.astype(np.float32), int(mask.sum())
