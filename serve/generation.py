"""One completion: its prompt submitted to the engine, its tokens turned into text, its end accounted for.

The engine's own ends are "stop" (end-of-sequence) and "length"; a stop string found in the text cancels the
engine's request and ends as "stop" too. A completion whose caller goes away (the client disconnected, the
stream was closed) cancels its request, so its slot is free for the next.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from tensorsmith.runtime.engine import GenerationEngine, QueueFull
from tensorsmith.runtime.errors import InferenceError, InputError
from tensorsmith.serve.errors import OpenAIError
from tensorsmith.serve.metrics import ServeMetrics
from tensorsmith.serve.protocol import EngineSampling
from tensorsmith.serve.text import TextCodec, TextStream

logger = logging.getLogger("tensorsmith.serve.requests")
Disconnected = Callable[[], Awaitable[bool]]  # whether the caller went away (Request.is_disconnected)


@dataclass(frozen=True)
class Piece:
    text: str
    token: int | None  # None: text held back until the end


class Completion:
    def __init__(
        self,
        engine: GenerationEngine,
        codec: TextCodec,
        prompt: list[int],
        max_tokens: int | None,
        stops: list[str],
        sampling: EngineSampling,
        prompt_param: str = "prompt",
    ) -> None:
        if not prompt:
            raise OpenAIError(400, "the prompt has no tokens", param=prompt_param)
        room = engine.capacity - len(prompt)
        if room < 1:
            raise OpenAIError(
                400,
                f"the prompt is {len(prompt)} tokens; this model's slots hold {engine.capacity} with the completion",
                param=prompt_param,
                code="context_length_exceeded",
                hint="shorten the prompt",
            )
        max_new = room if max_tokens is None else max_tokens
        if max_new > room:
            raise OpenAIError(
                400,
                f"max_tokens is {max_new}, but a prompt of {len(prompt)} tokens leaves room for "
                f"{room} in this model's {engine.capacity}",
                param="max_tokens",
                code="context_length_exceeded",
                hint=f"ask for {room} or fewer",
            )
        try:
            self.stream = engine.submit(prompt, max_new_tokens=max_new, **sampling)
        except QueueFull as err:
            raise OpenAIError(429, err.message, hint=err.hint) from err
        except InputError as err:
            raise OpenAIError(400, err.message, hint=err.hint) from err
        except InferenceError as err:  # the engine is shutting down
            raise OpenAIError(503, err.message) from err
        self.text = TextStream(codec.decode, stops)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.text.stopped else "length" if self.stream.finish_reason == "length" else "stop"

    async def pieces(self) -> AsyncIterator[Piece]:
        """Per new token, the text it settles ("" while a character or a possible stop string is incomplete);
        then what was held back. Ends early, cancelling the request, at a stop string."""
        try:
            async for token in self.stream:
                yield Piece(self.text.add(token), token)
                if self.text.stopped:
                    self.stream.cancel()
                    return
            if tail := self.text.flush():
                yield Piece(tail, None)
        except InferenceError as err:
            raise OpenAIError(500, f"generation failed: {err}") from err
        finally:
            if not self.stream.done:  # the caller left before the end
                self.stream.cancel()

    async def whole(self, disconnected: Disconnected) -> str:
        """All the text; cancelled when `disconnected()` (an awaitable predicate) turns true."""
        watcher = asyncio.create_task(_watch(self, disconnected))
        try:
            return "".join([piece.text async for piece in self.pieces()])
        finally:
            watcher.cancel()

    def account(self, metrics: ServeMetrics, endpoint: str) -> None:
        """Metrics and the request's log line, once it has ended."""
        stream, timings = self.stream, self.stream.timings
        metrics.finished(stream, self.finish_reason)
        record = {
            "request": stream.id,
            "endpoint": endpoint,
            "prompt_tokens": stream.prompt_tokens,
            "cached_tokens": stream.cached_tokens,
            "completion_tokens": stream.completion_tokens,
            "finish_reason": self.finish_reason,
            "cancelled": stream.cancelled and not self.text.stopped,
            "queue_s": _rounded(timings.queue_time),
            "ttft_s": _rounded(timings.time_to_first_token),
            "e2e_s": _rounded(timings.end_to_end),
        }
        logger.info("%s", json.dumps(record))


async def _watch(completion: Completion, disconnected: Disconnected) -> None:
    while not completion.stream.done:
        if await disconnected():
            completion.stream.cancel()
            return
        await asyncio.sleep(0.25)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
