"""The serving benchmark's OpenVINO GenAI anchor: its continuous batching pipeline on the same model and workload.

Drives openvino_genai.ContinuousBatchingPipeline on CPU in one thread: a closed loop of `clients` requests in
flight over bench/serve_workload.py's requests (token ids in, end-of-sequence ignored, greedy). Each step()
is the engine's one scheduling round; after it, every handle with new tokens gets one arrival stamp
(time.monotonic()) and its token count, and each finished request is replaced by the next one at once. Two
untimed requests warm it up first. The figures are serve_workload.figures'.

Runs in its own environment (openvino-genai pins its own stack), on a model exported with optimum-cli:

    python bench/serve_openvino.py OV_DIR CLIENTS COUNT OUT_JSON [PRECISION|default [SHARED_PREFIX_TOKENS]]

PRECISION: the CPU plugin's INFERENCE_PRECISION_HINT (`f32`, `bf16`); without it, the plugin's default, which is
bf16 on a CPU with AVX-512 BF16 or AMX (the benchmark machine's EPYC) and f32 elsewhere: tensorsmith's cpu target
computes in float32 on ONNX Runtime, so `f32` is the like-for-like side. SHARED_PREFIX_TOKENS:
bench/prefix_cache.py's workload (a system prompt that long shared by every request), with the pipeline's prefix
caching on.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.serve_workload import RequestTimes, WorkItem, figures, shared_prefix_workload, workload

MAX_SEQS = 32  # the most clients the benchmark runs
BATCHED_TOKENS = 256  # tokens per step, prompt chunks and decodes together (the library's default)
CACHE_GB = 1  # 32 x (256 + 128) tokens of this model's KV cache take ~0.6 GB even in f32
WARMUP = 2


def scheduler(prefix_caching: bool = False) -> ov_genai.SchedulerConfig:
    config = ov_genai.SchedulerConfig()
    config.max_num_seqs = MAX_SEQS
    config.max_num_batched_tokens = BATCHED_TOKENS
    config.dynamic_split_fuse = True  # prompts split into chunks that share steps with the decodes
    config.cache_size = CACHE_GB
    config.enable_prefix_caching = prefix_caching  # bench/serve.py's prompts are distinct: no reuse to measure
    return config


def generation_config(item: WorkItem) -> ov_genai.GenerationConfig:
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = item.max_new_tokens
    config.ignore_eos = True
    config.do_sample = False
    config.num_beams = 1
    return config


def closed_loop(pipe: ov_genai.ContinuousBatchingPipeline, items: list[WorkItem], clients: int) -> list[RequestTimes]:
    """Serve `items` with `clients` of them in flight; the times each request's client saw, in sending order."""
    times: list[RequestTimes] = []
    running: dict[int, Any] = {}  # request id -> GenerationHandle

    def send() -> None:
        item = items[len(times)]
        prompt = ov.Tensor(np.array([item.prompt], dtype=np.int64))
        times.append(RequestTimes(sent=time.monotonic()))
        running[len(times) - 1] = pipe.add_request(len(times) - 1, prompt, generation_config(item))

    while len(times) < min(clients, len(items)):
        send()
    while running:
        pipe.step()
        now = time.monotonic()
        for request, handle in list(running.items()):
            if handle.can_read():
                new = sum(len(output.generated_ids) for output in handle.read().values())
                if new:
                    times[request].arrivals.append(now)
                    times[request].tokens += new
            if handle.get_status() != ov_genai.GenerationStatus.RUNNING and not handle.can_read():
                del running[request]
                if len(times) < len(items):
                    send()
    return times


def main(
    model: str, clients: int, count: int, out: str, precision: str | None = None, shared_prefix: int = 0
) -> dict[str, Any]:
    core = ov.Core()
    properties = {} if precision is None else {"INFERENCE_PRECISION_HINT": precision}
    pipe = ov_genai.ContinuousBatchingPipeline(model, scheduler(shared_prefix > 0), "CPU", properties)
    closed_loop(pipe, workload(WARMUP, seed=1), WARMUP)
    # the same requests as bench/serve.py sends at this level, or as bench/prefix_cache.py sends
    items = shared_prefix_workload(count, shared_prefix) if shared_prefix else workload(count, seed=clients)
    start = time.monotonic()
    times = closed_loop(pipe, items, clients)
    wall = time.monotonic() - start
    config = scheduler()
    result: dict[str, Any] = {
        **figures(times, wall, clients),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "openvino_genai": ov_genai.__version__,
        "scheduler": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "dynamic_split_fuse": config.dynamic_split_fuse,
            "cache_size_gb": config.cache_size,
            "enable_prefix_caching": config.enable_prefix_caching,
        },
        # the compute precision asked for (else the CPU plugin's default) and the KV cache's (the plugin's default)
        "cpu": {
            key.lower(): properties.get(key) or core.get_property("CPU", key).to_string()
            for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION")
        },
    }
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6, 7):
        sys.exit(__doc__)
    precision = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "default" else None
    shared = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], precision, shared), indent=2))
