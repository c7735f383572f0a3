"""The server under a scaled-down soak (requests cancelled mid-stream and malformed ones among well-formed ones)
and a SIGTERM while it streams: every well-formed request answered whole, every malformed one a 4xx that says
why, no slot left taken, the running requests finished before it exits."""

from __future__ import annotations

import json
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.server import Server, serving

MALFORMED = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": 7}, "temperature"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": list(range(3, 700)), "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "model": "other"}, "model"),
    ({"prompt": "x", "n": 3}, "n"),
]


def _running(server: Server) -> tuple[float, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]


def _rss_kb(server: Server) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


@pytest.mark.slow
def test_soak_with_cancellations_and_malformed_requests(tinylm_cpu_artifact: Path) -> None:
    """240 requests from 16 clients on 4 slots: 10 % leave mid-stream, 5 % are malformed."""
    rng = random.Random(0)
    kinds = ["cancel" if rng.random() < 0.10 else "malformed" if rng.random() < 0.05 else "whole" for _ in range(240)]
    with serving(tinylm_cpu_artifact, "--slots", "4", "--max-queue", "64", "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)

        def one(index: int) -> str:
            kind, new = kinds[index], 8 + index % 40
            if kind == "malformed":
                body, param = MALFORMED[index % len(MALFORMED)]
                response = httpx.post(f"{server.api}/completions", json={"model": "m", **body})
                error = response.json()["error"]
                assert 400 <= response.status_code < 500 and error["message"] and error["param"] == param, error
                return "refused"
            stream = client.completions.create(
                model="m",
                prompt=f"Item {index}:",
                max_tokens=new,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunks, chunk in enumerate(stream, start=1):
                if kind == "cancel" and chunks == 3:
                    stream.close()
                    return "cancelled"
                if chunk.usage is not None:
                    assert chunk.usage.completion_tokens == new
                    return "whole"
            raise AssertionError(f"request {index} ended without its usage")

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(16)))  # warm-up: the allocator's and the sessions' first growth
            warm = _rss_kb(server)
            outcomes = list(pool.map(one, range(240)))
        assert outcomes == [{"malformed": "refused", "cancel": "cancelled"}.get(kind, kind) for kind in kinds]
        for _ in range(200):
            if _running(server) == (0, 0):
                break
        assert _running(server) == (0, 0)  # every slot free
        assert _rss_kb(server) < warm * 1.25  # no growth per request (the full soak's figure: docs/benchmarks.md)
        assert client.completions.create(model="m", prompt="x", max_tokens=3).usage is not None


@pytest.mark.slow
def test_sigterm_finishes_the_running_request_then_exits(tinylm_cpu_artifact: Path) -> None:
    with serving(tinylm_cpu_artifact, "--slots", "2") as server:
        body = {"prompt": "The with statement", "max_tokens": 300, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        events: list[str] = []
        stopped: dict[str, tuple[int, str]] = {}
        stopper = threading.Thread(target=lambda: stopped.update(result=server.stop()))
        with httpx.stream("POST", f"{server.api}/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:  # streaming: stop the server now
                    stopper.start()
        stopper.join(timeout=60)
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert events[-1] == "data: [DONE]" and usage["completion_tokens"] == 300
        status, output = stopped["result"]
        # uvicorn re-raises the signal it caught once it has shut down: the status says SIGTERM ended it
        assert status in (0, -signal.SIGTERM) and '"completion_tokens": 300' in output, output
