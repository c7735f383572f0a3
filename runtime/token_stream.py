"""A submitted request's tokens as they come: iterate it (`for` from a thread, `async for` in an event loop).

The engine's thread puts each new token id and then the end; a stream made inside a running event loop hands
them to that loop (call_soon_threadsafe into an asyncio.Queue), any other to a thread-safe queue. After the end,
`finish_reason` says why ("stop": an end-of-sequence or stop token, "length": max_new_tokens, "cancelled") and
`timings` when each stage happened, for metrics and logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from tensorsmith.runtime.errors import InferenceError

_END = object()
_ids = itertools.count(1)


@dataclass
class StreamTimings:
    """time.monotonic() stamps: arrived (submitted), scheduled (given a slot), token_times, finished."""

    arrived: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrived

    @property
    def time_to_first_token(self) -> float | None:
        return self.token_times[0] - self.arrived if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return [later - earlier for earlier, later in itertools.pairwise(self.token_times)]

    @property
    def end_to_end(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrived


class TokenStream:
    def __init__(self, prompt_tokens: int, wake: Callable[[], None]) -> None:
        self.id = next(_ids)
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # prompt tokens found in the slot's cache, not read again (runtime/prefix_cache.py)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: InferenceError | None = None
        self.timings = StreamTimings()
        self.cancelled = False
        self._wake = wake
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async: asyncio.Queue[object] = asyncio.Queue()
        self._sync: queue.SimpleQueue[object] = queue.SimpleQueue()

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop generating: the slot is freed before the next step, and the stream ends with "cancelled"."""
        self.cancelled = True
        self._wake()

    # the engine's side
    def put(self, token: int) -> None:
        self.tokens.append(token)
        self.timings.token_times.append(time.monotonic())
        self._hand(token)

    def finish(self, reason: str, error: InferenceError | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self.timings.finished = time.monotonic()
        self._hand(_END)

    def _hand(self, item: object) -> None:
        if self._loop is None:
            self._sync.put(item)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)

    # the caller's side
    def _end(self) -> None:
        if self.error is not None:
            raise self.error

    def __iter__(self) -> Iterator[int]:
        if self._loop is not None:
            raise RuntimeError("this stream was submitted inside an event loop: iterate it with `async for`")
        while (item := self._sync.get()) is not _END:
            assert isinstance(item, int)
            yield item
        self._end()

    async def __aiter__(self) -> AsyncIterator[int]:
        if self._loop is None:
            raise RuntimeError("this stream was submitted outside an event loop: iterate it with `for`")
        while (item := await self._async.get()) is not _END:
            assert isinstance(item, int)
            yield item
        self._end()
