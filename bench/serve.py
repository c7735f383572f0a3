"""Serving under load: `tensorsmith serve` driven by OpenAI's own Python client at 1, 8 and 32 concurrent clients,
beside one request at a time through `load().generate` and OpenVINO GenAI's continuous-batching pipeline on the
same model, each side its own process.

    .venv/bin/python -m bench.serve [smollm-135m] [--openvino /tmp/ov-venv/bin/python OV_MODEL_DIR] [-- COMPILE_FLAGS]

COMPILE_FLAGS go to our side's compile (e.g. `--precision int4 --int4-algorithm rtn --int4-block-size 64`, beside
an OpenVINO model exported with `--weight-format int4 --group-size 64 --sym`).

The model: a decoder of the shape's public config (bench/shapes.py, seeded bf16 weights), compiled for the cpu
target (`--max-sequence-length 512 --max-batch 32`: the workload's longest request is 384 tokens). The workload
(bench/serve_workload.py): the same token-id prompts of 32-256 tokens and 16-128 new tokens (end-of-sequence
ignored) for every side, closed loop. The server runs `--slots 32`; its clients stream
(`stream_options.include_usage`) from this process with AsyncOpenAI, so the client's own work shares the
machine's cores with the server, which OpenVINO GenAI's in-process pipeline does not pay.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_workload import RequestTimes, engine_closed_loop, figures, workload
from bench.shapes import make_checkpoint

SHAPES_DIRECTORY = Path("/tmp/tensorsmith-shapes")
LEVELS = {1: 8, 8: 32, 32: 128}  # clients: requests (4 per client: the closed loop past its start and before its end)
SLOTS = 32
OPENVINO_SIDES = {"OpenVINO GenAI ContinuousBatchingPipeline": [],
                  "OpenVINO GenAI ContinuousBatchingPipeline, f32 compute": ["f32"]}  # fmt: skip


async def _drive(api: str, clients: int, count: int, seed: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=api, api_key="unused", max_retries=0, timeout=600)
    items = workload(count, seed)
    times: list[RequestTimes] = []

    async def one(prompt: list[int], new: int) -> None:
        request = RequestTimes(time.monotonic())
        stream = await client.completions.create(model="model", prompt=prompt, max_tokens=new, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        async for chunk in stream:  # a chunk per token: random weights' tokens are mostly not the tokenizer's text
            if chunk.choices and getattr(chunk.choices[0], "token_ids", None):
                request.arrivals.append(time.monotonic())
            if chunk.usage is not None:
                request.tokens = chunk.usage.completion_tokens
        times.append(request)

    async def worker(queue: list[int]) -> None:
        while queue:
            index = queue.pop()
            await one(items[index].prompt, items[index].max_new_tokens)

    pending = list(range(count))[::-1]
    started = time.monotonic()
    await asyncio.gather(*(worker(pending) for _ in range(clients)))
    wall = time.monotonic() - started
    await client.close()
    return figures(times, wall, clients)


def serve_side(artifact: Path) -> dict[str, Any]:
    """The server in its own process; each level after a warm-up of 2 requests."""
    from tests.serve.server import serving

    with serving(artifact, "--slots", str(SLOTS), "--served-model-name", "model") as server:
        results: dict[str, Any] = {}
        for clients, count in LEVELS.items():
            asyncio.run(_drive(server.api, 2, 2, seed=99))
            results[str(clients)] = asyncio.run(_drive(server.api, clients, count, seed=clients))
            print(f"tensorsmith serve, {clients} clients: {results[str(clients)]}", file=sys.stderr, flush=True)
        results["peak_rss_gb"] = round(server.memory_kb("VmHWM") / 1e6, 3)
        return results


def one_at_a_time(artifact: str, out: str) -> None:
    """In its own process: the 1-client workload through `load().generate`, one request after another."""
    import numpy as np

    from tensorsmith.runtime import load

    items = workload(LEVELS[1], seed=1)
    with load(artifact, backend="onnxruntime") as model:
        model.generate(np.array(items[0].prompt), max_new_tokens=4)  # warm-up
        times = []
        started = time.monotonic()
        for item in items:
            request = RequestTimes(time.monotonic())
            model.generate(np.array(item.prompt), max_new_tokens=item.max_new_tokens, eos_token_id=[],
                           streamer=lambda _, request=request: request.arrivals.append(time.monotonic()))  # fmt: skip
            request.tokens = len(request.arrivals)
            times.append(request)
        result = figures(times, time.monotonic() - started, 1)
    Path(out).write_text(json.dumps(result))


def in_process(artifact: str, clients: int, backend: str = "onnxruntime") -> dict[str, Any]:
    """The 32-client level on the engine itself (`load().engine`, threads as clients, no HTTP), with the time
    its model calls take, prefill and decode apart: where the server's time goes.

        .venv/bin/python -m bench.serve --in-process ARTIFACT [CLIENTS [BACKEND]]
    """
    from collections import defaultdict

    import numpy as np

    from tensorsmith.runtime import load

    items = workload(LEVELS[clients], seed=clients)
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # calls, seconds, tokens or rows
    with load(artifact, backend=backend) as model, model.engine(slots=SLOTS) as engine:
        list(engine.submit(np.array(items[0].prompt), max_new_tokens=4))  # warm-up
        step = engine._slots.step

        def timed_step(feeds: Any, visible: Any) -> Any:
            started = time.perf_counter()
            logits = step(feeds, visible)
            kind = "prefill" if feeds.input_ids.shape[1] > 1 else "decode"
            record = calls[kind]
            record[0] += 1
            record[1] += time.perf_counter() - started
            record[2] += feeds.input_ids.shape[1] if kind == "prefill" else int(visible.sum())
            return logits

        engine._slots.step = timed_step
        result, _ = engine_closed_loop(engine, items, clients)
    model_calls = {
        kind: {"calls": int(c), "seconds": round(s, 2), "tokens": int(n)} for kind, (c, s, n) in calls.items()
    }
    return {**result, "model_calls": model_calls}


def main() -> None:
    if sys.argv[1:2] == ["--one-at-a-time"]:
        one_at_a_time(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1:2] == ["--in-process"]:
        clients = int(sys.argv[3]) if len(sys.argv) > 3 else 32
        backend = sys.argv[4] if len(sys.argv) > 4 else "onnxruntime"
        print(json.dumps(in_process(sys.argv[2], clients, backend), indent=2))
        return
    arguments = sys.argv[1:]
    compile_flags: list[str] = []
    if "--" in arguments:
        at = arguments.index("--")
        arguments, compile_flags = arguments[:at], arguments[at + 1 :]
    openvino = None
    if "--openvino" in arguments:
        at = arguments.index("--openvino")
        openvino = (arguments[at + 1], arguments[at + 2])
        del arguments[at : at + 3]
    shape = arguments[0] if arguments else "smollm-135m"
    checkpoint = make_checkpoint(shape, SHAPES_DIRECTORY / shape)
    results: dict[str, Any] = {"shape": shape, "compile_flags": compile_flags}
    with tempfile.TemporaryDirectory(prefix="tensorsmith-serve-") as scratch:
        artifact = Path(scratch) / "artifact"
        subprocess.run([str(Path(sys.executable).with_name("tensorsmith")), "compile", str(checkpoint), "-o",
                        str(artifact), "--target", "cpu", "--max-sequence-length", "512", "--max-batch", str(SLOTS),
                        *compile_flags],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        results["tensorsmith serve (slots 32)"] = serve_side(artifact)
        out = Path(scratch) / "one.json"
        subprocess.run([sys.executable, "-m", "bench.serve", "--one-at-a-time", str(artifact), str(out)], check=True)
        results["load().generate, one at a time"] = json.loads(out.read_text())
    if openvino is not None:
        python, model_dir = openvino
        script = str(Path(__file__).with_name("serve_openvino.py"))
        # its CPU defaults (bf16 compute where the CPU has AVX-512 BF16), and f32 compute: tensorsmith's cpu target's
        for side, precision in OPENVINO_SIDES.items():
            results[side] = {}
            for clients, count in LEVELS.items():
                out = Path(tempfile.mkstemp(suffix=".json")[1])
                command = [python, script, model_dir, str(clients), str(count), str(out), *precision]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)  # its figures are in `out`
                results[side][str(clients)] = json.loads(out.read_text())
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
