"""The serving benchmark's workload and its figures, shared by every side (bench/serve.py and the anchors).

Requests are token ids, the same for every side: prompts cut from CPython's pydoc_data topics (tokenized with
the tinylm sample's tokenizer, the one bench/shapes.py puts in every shape's checkpoint), of 32 to 256 tokens,
each asking 16 to 128 new tokens with the end-of-sequence ignored (random weights would end at random). A
closed loop: `clients` requests in flight, the next one sent as soon as one ends.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER = Path(__file__).resolve().parent.parent / "samples" / "tinylm" / "checkpoint" / "tokenizer.json"
PROMPT_TOKENS = (32, 256)
NEW_TOKENS = (16, 128)


@dataclass(frozen=True)
class WorkItem:
    prompt: list[int]
    max_new_tokens: int


def _text() -> list[int]:
    import pydoc_data.topics

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    return list(tokenizer.encode(" ".join(pydoc_data.topics.topics.values())).ids)


def shared_prefix_workload(count: int, prefix_tokens: int) -> list[WorkItem]:
    """`count` requests that share their first `prefix_tokens` (a system prompt), then a question of 16-64 tokens of
    their own, asking 16-32 new tokens: bench/prefix_cache.py's workload, the same on every side."""
    text, rng = _text(), np.random.default_rng(0)
    system = [1, *text[: prefix_tokens - 1]]
    items = []
    for _ in range(count):
        length = int(rng.integers(16, 65))
        start = int(rng.integers(prefix_tokens, len(text) - length))
        items.append(WorkItem(system + text[start : start + length], int(rng.integers(16, 33))))
    return items


def workload(count: int, seed: int = 0) -> list[WorkItem]:
    """`count` requests, the same ones for a seed on every side."""
    text = _text()
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(count):
        length = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        start = int(rng.integers(0, len(text) - length))
        new = int(rng.integers(NEW_TOKENS[0], NEW_TOKENS[1] + 1))
        items.append(WorkItem([1, *text[start : start + length - 1]], new))
    return items


@dataclass
class RequestTimes:
    """One request seen by its client: when it was sent, when each token (or chunk of tokens) came, how many."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], share: float) -> float | None:
    return float(np.percentile(values, share)) if values else None


def figures(times: list[RequestTimes], wall: float, clients: int) -> dict[str, float | int | None]:
    """Output tokens/s over the run, time to first token and inter-token latency (p50, p99), in seconds."""
    first = [request.arrivals[0] - request.sent for request in times if request.arrivals]
    gaps = [later - earlier for request in times for earlier, later in itertools.pairwise(request.arrivals)]
    tokens = sum(request.tokens for request in times)
    return {
        "clients": clients,
        "requests": len(times),
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": _rounded(percentile(first, 50)),
        "ttft_p99_s": _rounded(percentile(first, 99)),
        "itl_p50_s": _rounded(percentile(gaps, 50)),
        "itl_p99_s": _rounded(percentile(gaps, 99)),
        "mean_ttft_s": _rounded(statistics.fmean(first) if first else None),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def engine_closed_loop(engine: Any, items: list[WorkItem], clients: int) -> tuple[dict[str, Any], list[Any]]:
    """`items` through a runtime engine (`load().engine`, no HTTP), `clients` threads each sending its next request
    as its last ends: the figures, and each request's finished stream."""
    pending, lock = list(range(len(items)))[::-1], threading.Lock()
    times: list[RequestTimes] = []
    streams: list[Any] = []

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                item = items[pending.pop()]
            request = RequestTimes(time.monotonic())
            stream = engine.submit(np.array(item.prompt), max_new_tokens=item.max_new_tokens, ignore_eos=True)
            for _ in stream:
                request.arrivals.append(time.monotonic())
            request.tokens = len(request.arrivals)
            times.append(request)
            streams.append(stream)

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return figures(times, time.monotonic() - started, clients), streams
