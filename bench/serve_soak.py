"""A soak of a running `tensorsmith serve`: many requests from many clients, some cancelled mid-stream by their
client, some malformed, each checked; then the server's slots and memory.

    .venv/bin/python -m bench.serve_soak build/tinylm [REQUESTS=2000] [CLIENTS=32]

(the test tests/serve/test_reliability.py runs it scaled down). Every well-formed request must stream its
`max_tokens` (end-of-sequence ignored) and its usage; every malformed one must get a 4xx in OpenAI's form naming
the field; at the end no request runs or waits, and the server's RSS is compared with its RSS after a warm-up.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.serve.server import Server, serving

# (body, the field its error must name)
MALFORMED: list[tuple[dict[str, object], str]] = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": 7}, "temperature"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": list(range(3, 700)), "max_tokens": 4}, "prompt"),  # longer than the slots
    ({"prompt": "x", "model": "other"}, "model"),
    ({"prompt": "x", "n": 3}, "n"),
]


@dataclass
class SoakResult:
    outcomes: Counter[str]  # whole, cancelled, refused
    failures: list[str]  # what went wrong, per request (empty when the soak passed)
    rss_after_warmup_kb: int
    rss_at_end_kb: int
    running_at_end: float
    waiting_at_end: float

    @property
    def rss_growth(self) -> float:
        return self.rss_at_end_kb / self.rss_after_warmup_kb - 1


def plan(requests: int, seed: int = 0) -> list[str]:
    """Each request's kind: 10 % cancelled by their client, 5 % malformed, the rest whole."""
    rng = random.Random(seed)
    return ["cancel" if rng.random() < 0.10 else "malformed" if rng.random() < 0.05 / 0.9 else "whole"
            for _ in range(requests)]  # fmt: skip


def _request(api: str, model: str, index: int, kind: str) -> str:
    """One request as its client sends it; returns its outcome or raises AssertionError saying what was wrong."""
    if kind == "malformed":
        body, param = MALFORMED[index % len(MALFORMED)]
        response = httpx.post(f"{api}/completions", json={"model": model, **body}, timeout=120)
        error = response.json().get("error", {})
        assert 400 <= response.status_code < 500 and error.get("message"), (response.status_code, error)
        assert error.get("param") == param, (param, error)
        return "refused"
    new = 8 + index % 40
    body = {"model": model, "prompt": f"Item {index}:", "max_tokens": new, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{api}/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = 0
        for line in response.iter_lines():
            if not line:
                continue
            events += 1
            if kind == "cancel" and events == 3:
                return "cancelled"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                break
            usage = json.loads(line.removeprefix("data: ")).get("usage")
            if usage is not None:
                assert usage["completion_tokens"] == new, usage
    assert line == "data: [DONE]"
    return "whole"


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def soak(server: Server, model: str, requests: int, clients: int, seed: int = 0) -> SoakResult:
    """Soak `server`, serving `model`."""
    url, api = server.url, server.api
    kinds = plan(requests, seed)
    failures: list[str] = []

    def one(index: int) -> str:
        try:
            return _request(api, model, index, kinds[index])
        except (AssertionError, httpx.HTTPError) as err:
            failures.append(f"request {index} ({kinds[index]}): {err!r}")
            return "failed"

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda index: _request(api, model, index, "whole"), range(clients)))  # warm-up
        warm = server.memory_kb()
        outcomes = Counter(pool.map(one, range(requests)))
    for _ in range(200):  # a cancelled request's slot frees at the engine's next turn
        gauges = _gauges(url)
        if gauges["vllm:num_requests_running"] == gauges["vllm:num_requests_waiting"] == 0:
            break
    return SoakResult(outcomes, failures, warm, server.memory_kb(), gauges["vllm:num_requests_running"],
                      gauges["vllm:num_requests_waiting"])  # fmt: skip


def main() -> None:
    import time

    artifact = Path(sys.argv[1])
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    clients = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    with serving(artifact, "--slots", "8", "--served-model-name", "m") as server:
        started = time.monotonic()
        result = soak(server, "m", requests, clients)
        wall = time.monotonic() - started
    print(json.dumps({"requests": requests, "clients": clients, "wall_s": round(wall, 1),
                      "outcomes": dict(result.outcomes), "failures": result.failures[:10],
                      "running_at_end": result.running_at_end, "waiting_at_end": result.waiting_at_end,
                      "rss_after_warmup_mb": round(result.rss_after_warmup_kb / 1e3, 1),
                      "rss_at_end_mb": round(result.rss_at_end_kb / 1e3, 1),
                      "rss_growth": round(result.rss_growth, 4)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
