"""`DynamicBatcher`: gather concurrent requests into one model call, as Triton's dynamic batcher does in-process.

    batcher = DynamicBatcher(model, max_batch=32, max_delay_ms=15)
    outputs = await batcher.run({"input_ids": ids, "attention_mask": mask})   # from many tasks at once

Requests whose inputs agree on every dim but the first (the batch) are concatenated, oldest first, up to
`max_batch` rows (capped by the model's own limit, the engine profile's max batch); a batch goes as soon as it
is full or when its oldest request has waited `max_delay_ms`. Each request gets back exactly its own rows. The
batches go one model call at a time, each in a worker thread, so the event loop stays free while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tensorsmith.runtime.specs import TensorSpec, with_default_token_types

logger = logging.getLogger(__name__)

Key = tuple[tuple[str, str, tuple[int, ...]], ...]  # per input: name, dtype, dims after the batch


class BatchableModel(Protocol):
    @property
    def inputs(self) -> list[TensorSpec]: ...

    @property
    def max_batch(self) -> int | None: ...

    def run(self, feeds: Mapping[str, object]) -> dict[str, np.ndarray]: ...


@dataclass(eq=False)  # requests compare by identity (their feeds are arrays)
class _Request:
    feeds: dict[str, np.ndarray]
    rows: int
    key: Key
    future: asyncio.Future[dict[str, np.ndarray]]
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class BatcherStats:
    requests: int = 0
    model_calls: int = 0
    rows: int = 0

    @property
    def mean_batch(self) -> float:
        return self.rows / self.model_calls if self.model_calls else 0.0


class DynamicBatcher:
    def __init__(
        self,
        model: BatchableModel,
        max_batch: int = 32,
        max_delay_ms: float = 15.0,
        executor: Executor | None = None,
    ) -> None:
        if max_batch < 1 or max_delay_ms < 0:
            raise ValueError(f"max_batch must be >= 1 and max_delay_ms >= 0 (got {max_batch}, {max_delay_ms})")
        limit = model.max_batch
        self.model = model
        self.max_batch = min(max_batch, limit) if limit else max_batch
        self.max_delay = max_delay_ms / 1000
        self.stats = BatcherStats()
        self._executor = executor
        self._names = [spec.name for spec in model.inputs]
        self._pending: list[_Request] = []
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    async def run(self, feeds: Mapping[str, object]) -> dict[str, np.ndarray]:
        """The model's outputs for `feeds` (a batch of one or more rows), computed together with whatever other
        requests arrive meanwhile. Raises ValueError for feeds that cannot be batched."""
        arrays, rows = self._check(feeds)
        self.stats.requests += 1
        if rows > self.max_batch:  # too big to share a call: its own calls, max_batch rows at a time
            parts = [
                await self._call({name: array[start : start + self.max_batch] for name, array in arrays.items()})
                for start in range(0, rows, self.max_batch)
            ]
            return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        loop = asyncio.get_running_loop()
        key = tuple((name, arrays[name].dtype.str, arrays[name].shape[1:]) for name in self._names)
        request = _Request(arrays, rows, key, loop.create_future())
        self._pending.append(request)
        if self._worker is None or self._worker.done():
            # A worker (and its event) per busy period, in the running loop: a batcher outlives asyncio.run().
            self._arrived = asyncio.Event()
            self._worker = asyncio.create_task(self._serve())
        assert self._arrived is not None
        self._arrived.set()
        return await request.future

    def _check(self, feeds: Mapping[str, object]) -> tuple[dict[str, np.ndarray], int]:
        feeds = with_default_token_types(feeds, self.model.inputs)  # as Model.run does: requests batch alike
        missing = [name for name in self._names if name not in feeds]
        unknown = [name for name in feeds if name not in self._names]
        if missing or unknown:
            raise ValueError(f"feeds must name exactly the inputs {self._names} (missing {missing}, unknown {unknown})")
        arrays = {name: np.asarray(feeds[name]) for name in self._names}
        rows = {name: array.shape[0] if array.ndim else 0 for name, array in arrays.items()}
        if len(set(rows.values())) != 1 or min(rows.values()) < 1:
            raise ValueError(f"every input needs the same batch (first) dim of at least 1, got {rows}")
        return arrays, next(iter(rows.values()))

    async def _serve(self) -> None:
        """Take batches from the pending requests, oldest first, until none is left. Should the loop itself
        fail, every waiting request gets the error rather than waiting forever."""
        try:
            await self._serve_pending()
        except Exception as err:
            for request in self._pending:
                if not request.future.done():
                    request.future.set_exception(err)
            self._pending = []
            raise

    async def _serve_pending(self) -> None:
        assert self._arrived is not None
        while self._pending:
            oldest = self._pending[0]
            group = [request for request in self._pending if request.key == oldest.key]
            waited = time.monotonic() - oldest.arrived
            if sum(request.rows for request in group) < self.max_batch and waited < self.max_delay:
                self._arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):  # a new request, or the oldest's delay is up
                    await asyncio.wait_for(self._arrived.wait(), self.max_delay - waited)
                continue
            batch, rows = [], 0
            for request in group:
                if rows + request.rows > self.max_batch:
                    break
                batch.append(request)
                rows += request.rows
            self._pending = [request for request in self._pending if request not in batch]
            await self._execute(batch, rows)

    async def _execute(self, batch: list[_Request], rows: int) -> None:
        feeds = {name: np.concatenate([request.feeds[name] for request in batch]) for name in self._names}
        try:
            outputs = await self._call(feeds)
            for name, array in outputs.items():
                if array.ndim == 0 or array.shape[0] != rows:
                    raise ValueError(f"output '{name}' has shape {array.shape}: no batch dim of {rows} to split")
        except Exception as err:  # every request in the batch gets the model's error
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(err)
            return
        start = 0
        for request in batch:
            end = start + request.rows
            if not request.future.done():  # its caller may have been cancelled
                request.future.set_result({name: array[start:end].copy() for name, array in outputs.items()})
            start = end
        logger.debug("batched %d requests (%d rows) into one call", len(batch), rows)

    async def _call(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.stats.model_calls += 1
        self.stats.rows += next(iter(feeds.values())).shape[0]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.model.run, feeds)
