"""Response bodies as OpenAI's API writes them, whole and as server-sent-event chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from tensorsmith.runtime.token_stream import TokenStream

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Answer:
    """One request's identity, shared by its chunks: id, creation time, model name, chat or text completion."""

    model: str
    chat: bool
    id: str = ""
    created: int = 0

    @staticmethod
    def new(model: str, chat: bool) -> Answer:
        prefix = "chatcmpl" if chat else "cmpl"
        return Answer(model, chat, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _head(self, chunk: bool) -> dict[str, object]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self,
        text: str | None,
        finish_reason: str | None,
        chunk: bool,
        first: bool = False,
        token_ids: list[int] | None = None,
    ) -> dict[str, object]:
        ids = {} if token_ids is None else {"token_ids": token_ids}  # vLLM's return_token_ids
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason, **ids}
        if chunk:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, **ids}
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, **ids}

    def whole(
        self, text: str, finish_reason: str, stream: TokenStream, token_ids: list[int] | None = None
    ) -> dict[str, object]:
        return {
            **self._head(False),
            "choices": [self._choice(text, finish_reason, False, token_ids=token_ids)],
            "usage": usage(stream),
        }

    def opening(self) -> str:
        """A chat stream's first chunk (the assistant's role); text completions have none."""
        return sse({**self._head(True), "choices": [self._choice(None, None, True, first=True)]}) if self.chat else ""

    def piece(self, text: str, token_ids: list[int] | None = None) -> str:
        return sse({**self._head(True), "choices": [self._choice(text, None, True, token_ids=token_ids)]})

    def closing(self, finish_reason: str) -> str:
        return sse({**self._head(True), "choices": [self._choice(None, finish_reason, True)]})

    def usage_chunk(self, stream: TokenStream) -> str:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return sse({**self._head(True), "choices": [], "usage": usage(stream)})


def usage(stream: TokenStream) -> dict[str, object]:
    """OpenAI's usage, with the prompt tokens the engine found cached (`prompt_tokens_details.cached_tokens`)."""
    return {
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": stream.completion_tokens,
        "total_tokens": stream.prompt_tokens + stream.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stream.cached_tokens},
    }


def sse(body: Mapping[str, object]) -> str:
    return f"data: {json.dumps(body)}\n\n"
