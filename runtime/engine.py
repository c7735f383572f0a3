"""`GenerationEngine`: continuous (in-flight) batching over a decoder artifact's static KV cache.

    engine = load("build/tinylm").engine(slots=8)
    stream = engine.submit(prompt_ids, max_new_tokens=64)
    async for token in stream: ...

One thread runs the model. Each turn it gives waiting requests the free slots (a slot that still holds the start of
the prompt first: runtime/prefix_cache.py; else the lowest, so the running ones stay packed at the front), reads up
to `prefill_chunk` prompt tokens of the requests still reading theirs (oldest first, a model call each: a long
prompt takes several turns, so the running requests keep decoding in between), then runs one decode step for every
decoding slot in one model call. A request that ends (end-of-sequence, a stop token, max_new_tokens) or is
cancelled frees its slot before the next turn. Greedy tokens are `Model.generate`'s for the same request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tensorsmith.runtime.errors import InferenceError, InputError
from tensorsmith.runtime.generation_request import check_request
from tensorsmith.runtime.manifest import Manifest
from tensorsmith.runtime.prefix_cache import KeptPrefixes
from tensorsmith.runtime.sampling import Sampling
from tensorsmith.runtime.slots import SlotCache, SlotFeeds
from tensorsmith.runtime.token_stream import TokenStream

logger = logging.getLogger(__name__)

# Free slots between two decoding ones that are cheaper to run as throwaway rows than to split the call: a decode
# call's fixed cost (reading every weight once) is about that of 8 more rows on a CPU (docs/benchmarks.md).
SPLIT_GAP = 8


class QueueFull(InputError):
    """More requests wait than the engine's `max_queue`: try again later (a server's 429)."""


@dataclass(eq=False)
class _Running:
    stream: TokenStream
    prompt: np.ndarray
    max_new_tokens: int
    sampling: Sampling
    rng: np.random.Generator
    stop: set[int]
    slot: int = -1
    read: int = 0  # prompt tokens in the cache
    cached: int = 0  # tokens in the cache (prompt and generated, the last generated one not yet)
    generated: list[int] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.read == len(self.prompt)


@dataclass(frozen=True)
class EngineStats:
    slots: int
    running: int
    waiting: int


class GenerationEngine:
    def __init__(
        self,
        slots: SlotCache,
        manifest: Manifest,
        origin: str,
        max_queue: int = 256,
        prefill_chunk: int = 256,
        prefix_caching: bool = True,
    ) -> None:
        self._slots = slots
        # a recurrent layer's state holds every token it has read, not one per position: no prefix of it is kept
        self._prefixes = KeptPrefixes(prefix_caching and not slots.states)
        self._manifest = manifest
        self._origin = origin
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self._pad = manifest.generation.pad_token_id or 0 if manifest.generation else 0
        self._waiting: deque[_Running] = deque()
        self._running: dict[int, _Running] = {}
        self._turn = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="tensorsmith-engine", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> int:
        return self._slots.slots

    @property
    def prefix_caching(self) -> bool:
        """Whether a prompt is looked up in the slots' kept prefixes (asked for, and no recurrent state)."""
        return self._prefixes.enabled

    @property
    def capacity(self) -> int:
        """Prompt and new tokens of one request, at most."""
        return self._slots.capacity

    def stats(self) -> EngineStats:
        with self._turn:
            return EngineStats(self.slots, len(self._running), len(self._waiting))

    def submit(
        self,
        prompt_ids: object,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
    ) -> TokenStream:
        """Queue one prompt (token ids [length]); its tokens come through the returned stream. Raises InputError
        naming a bad setting, QueueFull when `max_queue` requests wait already."""
        sampling = Sampling(do_sample, temperature, top_k, top_p)
        request = check_request(self._manifest, self._origin, prompt_ids, None, max_new_tokens, sampling, 1, seed=seed)
        if request.prompt.shape[0] != 1:
            raise InputError(f"submit takes one prompt, not {request.prompt.shape[0]}", hint="submit each on its own")
        prompt = request.prompt[0]
        if len(prompt) + max_new_tokens > self.capacity:
            raise InputError(
                f"a prompt of {len(prompt)} tokens and {max_new_tokens} new tokens do not fit the "
                f"engine's {self.capacity}-token slots",
                hint="shorten the prompt or ask for fewer new tokens",
            )
        stop = set(stop_token_ids or []) | (set() if ignore_eos else set(request.eos))
        stream = TokenStream(len(prompt), self._wake)
        running = _Running(stream, prompt, max_new_tokens, sampling, np.random.default_rng(seed), stop)
        with self._turn:
            if self._closing:
                raise InferenceError("the engine is shutting down and takes no new requests")
            if len(self._waiting) >= self.max_queue + self.slots - len(self._running):  # none free, queue full
                raise QueueFull(
                    f"{len(self._waiting)} requests wait already (max_queue {self.max_queue})",
                    hint="retry later, or serve with more slots or a longer queue",
                )
            self._waiting.append(running)
            self._turn.notify()
        return stream

    def close(self, drain: bool = True) -> None:
        """Stop taking requests; finish the running and waiting ones (`drain`), or cancel them; then release."""
        with self._turn:
            self._closing = True
            if not drain:
                for running in [*self._waiting, *self._running.values()]:
                    running.stream.cancelled = True
            self._turn.notify()
        self._thread.join()
        self._slots.close()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._turn:
            self._turn.notify()

    def _serve(self) -> None:
        while True:
            with self._turn:
                while not (self._waiting or self._running or self._closing):
                    self._turn.wait()
                self._end_cancelled()
                if self._closing and not (self._waiting or self._running):
                    return
                self._admit()
            try:
                self._turn_once()
            except InferenceError as err:  # the model failed: its requests end with the error, the engine goes on
                logger.error("a generation step failed: %s", err)
                with self._turn:
                    for slot, request in list(self._running.items()):
                        self._end(slot, request, "error", err)
                    self._prefixes.forget_all()

    def _end_cancelled(self) -> None:
        for request in [request for request in self._waiting if request.stream.cancelled]:
            self._waiting.remove(request)
            request.stream.finish("cancelled")
        for slot, request in list(self._running.items()):
            if request.stream.cancelled:
                self._end(slot, request, "cancelled")

    def _admit(self) -> None:
        free = set(range(self.slots)) - set(self._running)
        while self._waiting and free:
            request = self._waiting.popleft()
            choice = self._prefixes.choose(request.prompt, free)
            free.discard(choice.slot)
            request.slot = choice.slot
            request.read = request.cached = request.stream.cached_tokens = choice.reused
            self._slots.start(choice.slot, keep=choice.reused)
            request.stream.timings.scheduled = time.monotonic()
            self._running[request.slot] = request

    def _turn_once(self) -> None:
        """Up to `prefill_chunk` prompt tokens (the oldest reading requests first, a call each), then one decode
        step. Only this thread changes `_running` (the lock guards the queue)."""
        budget = self.prefill_chunk
        reading = sorted((r for r in self._running.values() if not r.decoding), key=lambda r: r.stream.id)
        for request in reading:
            if budget <= 0:
                break
            budget -= self._prefill(request, budget)
        decoding = {slot: request for slot, request in self._running.items() if request.decoding}
        if decoding:
            self._decode(decoding)

    def _prefill(self, request: _Running, budget: int) -> int:
        """Read up to `budget` more of a request's prompt into its slot; the tokens read."""
        start, slot = request.read, request.slot
        chunk = request.prompt[start : start + budget]
        positions = np.arange(start, start + len(chunk), dtype=np.int64)
        feeds = SlotFeeds(slice(slot, slot + 1), chunk[None, :], positions[None, :], np.array([start], np.int64))
        logits = self._slots.step(feeds, np.array([True]))
        request.read = request.cached = start + len(chunk)
        if request.decoding:
            self._accept(request, logits[0])
        return len(chunk)

    def _decode(self, decoding: dict[int, _Running]) -> None:
        """One token for every decoding slot: a call per run of slots, split where a gap is wide enough that its
        throwaway rows would cost more than another call (a call costs about as much as `SPLIT_GAP` rows)."""
        slots = sorted(decoding)
        first = 0
        for index in range(1, len(slots) + 1):
            if index == len(slots) or slots[index] - slots[index - 1] > SPLIT_GAP:
                self._decode_rows(slots[first], slots[index - 1] + 1, decoding)
                first = index

    def _decode_rows(self, start: int, stop: int, decoding: dict[int, _Running]) -> None:
        rows = stop - start
        ids = np.full((rows, 1), self._pad, np.int64)
        positions = np.zeros((rows, 1), np.int64)
        writes = np.zeros(rows, np.int64)
        visible = np.zeros(rows, bool)
        for row, slot in enumerate(range(start, stop)):
            request = self._running.get(slot)
            if request is not None and slot in decoding:
                ids[row, 0], positions[row, 0], writes[row] = request.generated[-1], request.cached, request.cached
                visible[row] = True
            elif request is not None:  # between prefill chunks: the throwaway lands where its next chunk writes
                writes[row] = request.read
            else:  # a free slot: past the tokens it keeps
                writes[row] = self._prefixes.throwaway_write(slot)
        logits = self._slots.step(SlotFeeds(slice(start, stop), ids, positions, writes), visible)
        for row, slot in enumerate(range(start, stop)):
            if visible[row]:
                decoding[slot].cached += 1
                self._accept(decoding[slot], logits[row])

    def _accept(self, request: _Running, logits: np.ndarray) -> None:
        """The next token from a row's logits: streamed, and the request ended when it is a stop or the last."""
        token = int(request.sampling.choose(logits[None, :], request.rng)[0])
        request.generated.append(token)
        request.stream.put(token)
        reason = (
            "stop" if token in request.stop else "length" if len(request.generated) == request.max_new_tokens else None
        )
        if reason is not None:
            with self._turn:
                self._end(request.slot, request, reason)

    def _end(self, slot: int, request: _Running, reason: str, error: InferenceError | None = None) -> None:
        """Free the slot (called with the lock held) and end the stream."""
        if self._running.get(slot) is request:
            del self._running[slot]
            self._slots.release(slot)
            # what the slot's cache holds for a later prompt with the same start
            generated = np.asarray(request.generated[: request.cached - request.read], np.int64)
            self._prefixes.keep(slot, np.concatenate([request.prompt[: request.read], generated]))
        request.stream.finish(reason, error)
