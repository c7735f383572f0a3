"""The server under a scaled-down soak (requests cancelled mid-stream and malformed ones among well-formed ones)
and a SIGTERM while it streams: every well-formed request answered whole, every malformed one a 4xx that says
why, no slot left taken, the running requests finished before it exits."""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from bench.serve_soak import plan, soak
from tests.serve.server import serving


@pytest.mark.slow
def test_soak_with_cancellations_and_malformed_requests(tinylm_cpu_artifact: Path) -> None:
    """bench/serve_soak.py scaled down: 240 requests from 16 clients on 4 slots, 10 % left mid-stream by their
    client, 5 % malformed."""
    with serving(tinylm_cpu_artifact, "--slots", "4", "--max-queue", "64", "--served-model-name", "m") as server:
        result = soak(server, "m", requests=240, clients=16)
        assert not result.failures, result.failures[:5]
        expected = Counter({"cancel": "cancelled", "malformed": "refused"}.get(kind, kind) for kind in plan(240))
        assert result.outcomes == expected and expected["cancelled"] and expected["refused"]
        assert (result.running_at_end, result.waiting_at_end) == (0, 0)  # every slot free
        assert result.rss_growth < 0.25  # no growth per request (the full soak's figure: docs/benchmarks.md)
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
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
