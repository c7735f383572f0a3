"""Prefix caching: requests that share a system prompt, with the engine's prefix caching on and off, beside OpenVINO
GenAI's continuous batching with its own prefix caching (f32 compute, as ours).

    .venv/bin/python -m bench.prefix_cache [smollm-135m] [--system-tokens=320] [--openvino PYTHON OV_MODEL_DIR]

The model: the shape's decoder compiled for the cpu target as bench/serve.py compiles it (the anchor: its OpenVINO
export, set up as bench/serve_openvino.py says). The workload (bench/serve_workload.py's shared_prefix_workload): 64
requests, each a system prompt of `--system-tokens` tokens shared by all and a question of 16-64 tokens of its own,
asking 16-32 new tokens (end-of-sequence ignored), 8 clients in a closed loop on the engine itself (`load().engine(
slots=8)`, threads as clients, no HTTP). Each side its own process; figures as bench/serve_workload.py computes them,
and the prompt tokens our engine found cached.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.serve import SHAPES_DIRECTORY, SLOTS
from bench.serve_workload import engine_closed_loop, shared_prefix_workload
from bench.shapes import make_checkpoint

CLIENTS = 8
REQUESTS = 64


def side(artifact: str, caching: bool, system_tokens: int) -> dict[str, Any]:
    """In its own process: the closed loop on the engine, prefix caching as `caching` says."""
    from tensorsmith.runtime import load

    items = shared_prefix_workload(REQUESTS, system_tokens)
    with load(artifact, backend="onnxruntime") as model, model.engine(slots=CLIENTS, prefix_caching=caching) as engine:
        list(engine.submit(np.array(items[0].prompt[:8]), max_new_tokens=2))  # warm-up, shares nothing
        result, streams = engine_closed_loop(engine, items, CLIENTS)
    cached = sum(stream.cached_tokens for stream in streams)
    prompt_tokens = sum(len(item.prompt) for item in items)
    return {**result, "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached}


def main() -> None:
    if sys.argv[1:2] == ["--side"]:
        print(json.dumps(side(sys.argv[2], sys.argv[3] == "on", int(sys.argv[4]))))
        return
    arguments = [arg for arg in sys.argv[1:2] if not arg.startswith("--")]
    system_tokens = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--system-tokens=")), 320)
    shape = arguments[0] if arguments else "smollm-135m"
    checkpoint = make_checkpoint(shape, SHAPES_DIRECTORY / shape)
    results: dict[str, Any] = {"shape": shape, "system_tokens": system_tokens}
    with tempfile.TemporaryDirectory(prefix="tensorsmith-prefix-") as scratch:
        artifact = Path(scratch) / "artifact"
        subprocess.run([str(Path(sys.executable).with_name("tensorsmith")), "compile", str(checkpoint), "-o",
                        str(artifact), "--target", "cpu", "--max-sequence-length", "512", "--max-batch", str(SLOTS)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        openvino = sys.argv.index("--openvino") if "--openvino" in sys.argv else None
        if openvino is not None:
            python, model_dir = sys.argv[openvino + 1 : openvino + 3]
            out = Path(scratch) / "openvino.json"
            script = str(Path(__file__).with_name("serve_openvino.py"))
            command = [python, script, model_dir, str(CLIENTS), str(REQUESTS), str(out), "f32", str(system_tokens)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            results["OpenVINO GenAI f32, prefix caching on"] = json.loads(out.read_text())
        for caching in ("on", "off"):
            run = subprocess.run([sys.executable, "-m", "bench.prefix_cache", "--side", str(artifact), caching,
                                  str(system_tokens)], check=True, capture_output=True, text=True)  # fmt: skip
            results[f"prefix caching {caching}"] = json.loads(run.stdout.strip().splitlines()[-1])
            print(caching, results[f"prefix caching {caching}"], file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
