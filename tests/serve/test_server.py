"""`tensorsmith serve` over samples/tinylm, as a service author meets it: a real server process on loopback, OpenAI's
own Python client, Prometheus' own parser."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tensorsmith.runtime import load
from tests.serve.server import Server, serving

VLLM_NAMES = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:generation_tokens",
    "vllm:kv_cache_usage_perc",
    "vllm:backend_info",
]


@pytest.fixture(scope="module")
def server(tinylm_cpu_artifact: Path) -> Iterator[Server]:
    with serving(tinylm_cpu_artifact, "--slots", "4", "--served-model-name", "tinylm") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def _greedy_text(artifact: Path, ids: list[int], new: int) -> str:
    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer" / "tokenizer.json"))
    with load(artifact, backend="onnxruntime") as model:
        tokens = model.generate(np.array(ids), max_new_tokens=new)[0, len(ids) :].tolist()
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def _metrics(server: Server) -> dict[str, dict[str, float]]:
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    return {
        family.name: {json.dumps(s.labels, sort_keys=True) + s.name: s.value for s in family.samples}
        for family in families
    }


def test_completions_are_generates_text(client: openai.OpenAI, tinylm_cpu_artifact: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tinylm_cpu_artifact / "tokenizer" / "tokenizer.json"))
    prompt = "The with statement"
    answer = client.completions.create(model="tinylm", prompt=prompt, max_tokens=24, temperature=0)
    expected = _greedy_text(tinylm_cpu_artifact, tokenizer.encode(prompt).ids, 24)
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 24
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)


def test_chat_streamed_and_whole_agree_with_generate(client: openai.OpenAI, tinylm_cpu_artifact: Path) -> None:
    messages = [
        {"role": "system", "content": "You answer about Python."},
        {"role": "user", "content": "What is a class?"},
    ]
    whole = client.chat.completions.create(model="tinylm", messages=messages, max_tokens=30, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model="tinylm",
            messages=messages,
            max_tokens=30,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    rendered = "<s>system: You answer about Python.\nuser: What is a class?\nassistant:"  # the sample's template
    tokenizer = Tokenizer.from_file(str(tinylm_cpu_artifact / "tokenizer" / "tokenizer.json"))
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert whole.choices[0].message.content == streamed == _greedy_text(tinylm_cpu_artifact, ids, 30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed_usage, usage = chunks[-1].usage, whole.usage
    assert chunks[-1].choices == [] and streamed_usage is not None and usage is not None
    assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert whole.usage.prompt_tokens == len(ids)


def test_a_repeated_system_prompt_is_read_from_the_slots_cache(
    client: openai.OpenAI, server: Server, tinylm_cpu_artifact: Path
) -> None:
    """The second conversation with the same system prompt reads only what follows the shared tokens; usage says
    how many were cached (OpenAI's `prompt_tokens_details.cached_tokens`), and so do vLLM's prefix-cache counters."""
    system = "You are a careful assistant who answers questions about the Python language in one short sentence."
    tokenizer = Tokenizer.from_file(str(tinylm_cpu_artifact / "tokenizer" / "tokenizer.json"))
    answers, ids = [], []
    for question in ("What is a tuple?", "How do I open a file?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        answers.append(client.chat.completions.create(model="tinylm", messages=messages, max_tokens=6, temperature=0))  # type: ignore[arg-type]
        rendered = f"<s>system: {system}\nuser: {question}\nassistant:"  # the sample's template
        ids.append(tokenizer.encode(rendered, add_special_tokens=False).ids)
        assert answers[-1].choices[0].message.content == _greedy_text(tinylm_cpu_artifact, ids[-1], 6)
    shared = next(index for index, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    cached = [answer.usage.prompt_tokens_details.cached_tokens for answer in answers if answer.usage is not None]
    assert cached == [0, shared] and shared > 20
    labels = json.dumps({"model_name": "tinylm"})
    hits = _metrics(server)["vllm:prefix_cache_hits"][labels + "vllm:prefix_cache_hits_total"]
    assert hits >= shared


def test_the_event_stream_ends_with_done(server: Server) -> None:
    body = {"model": "tinylm", "prompt": "def f(x):", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.api}/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(event.startswith("data: ") for event in events)


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tinylm", prompt="The with statement", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[8:11]
    cut = client.completions.create(
        model="tinylm", prompt="The with statement", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_bad_requests_are_400s_in_openais_form_and_the_server_goes_on(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="slots hold 512") as long:
        client.completions.create(model="tinylm", prompt=list(range(3, 600)), max_tokens=4)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="n is not supported") as many:
        client.completions.create(model="tinylm", prompt="x", n=2)
    assert many.value.param == "n"
    with pytest.raises(openai.NotFoundError, match="`gpt-4` does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    response = httpx.post(f"{server.api}/chat/completions", json={"model": "tinylm", "messages": [{"role": "robot"}]})
    error = response.json()["error"]
    assert (
        response.status_code == 400 and error["param"] == "messages.0.role" and error["type"] == "invalid_request_error"
    )
    assert set(error) == {"message", "type", "param", "code"}
    assert response.status_code == 400
    with pytest.raises(openai.BadRequestError, match="an encoder|embeddings"):
        client.embeddings.create(model="tinylm", input="x")
    assert client.completions.create(model="tinylm", prompt="x", max_tokens=2).choices[0].text is not None


def test_metrics_parse_and_carry_vllms_names(client: openai.OpenAI, server: Server) -> None:
    client.completions.create(model="tinylm", prompt="import os", max_tokens=8, temperature=0)
    metrics = _metrics(server)
    assert set(VLLM_NAMES) <= set(metrics)
    labels = json.dumps({"model_name": "tinylm"})
    assert metrics["vllm:generation_tokens"][labels + "vllm:generation_tokens_total"] >= 8
    assert metrics["vllm:time_to_first_token_seconds"][labels + "vllm:time_to_first_token_seconds_count"] >= 1


def test_concurrent_clients_and_disconnects_leave_no_slot_taken(client: openai.OpenAI, server: Server) -> None:
    """16 clients on 4 slots; some leave mid-stream (the server cancels them). Every slot is free at the end."""

    def one(index: int) -> str:
        stream = client.completions.create(
            model="tinylm",
            prompt=f"Example {index}",
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces = []
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if index % 4 == 0 and len(pieces) == 3:
                stream.close()  # the client goes away
                break
        return "".join(pieces)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16)))
    assert all(texts)
    for _ in range(100):  # the cancellations land within a few steps
        gauges = _metrics(server)
        running = gauges["vllm:num_requests_running"][
            json.dumps({"model_name": "tinylm"}) + "vllm:num_requests_running"
        ]
        if running == 0:
            break
    assert running == 0


def test_bad_serve_arguments_are_one_line_before_the_load(tinylm_cpu_artifact: Path, tmp_path: Path) -> None:
    from tests.conftest import run_cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = run_cli("serve", str(tinylm_cpu_artifact), "--port", port)
    assert busy.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    many = run_cli("serve", str(tinylm_cpu_artifact), "--slots", "64")
    assert many.exit_code == 1 and "--slots 64 is more than" in many.stderr and "largest batch, 8" in many.stderr
    missing = run_cli("serve", str(tmp_path / "nothing"))
    assert missing.exit_code == 1 and "nothing" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
