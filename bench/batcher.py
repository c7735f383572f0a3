"""DynamicBatcher against one model call per request, on the compiled MiniLM sample (ONNX Runtime, CPU).

    python bench/batcher.py [--artifact build/minilm] [--requests 64] [--repeats 5]

64 concurrent requests of one sentence each (64 tokens, held-out sentences): answered one `model.run` per
request (what a service does without batching), and through `DynamicBatcher(max_batch=32, max_delay_ms=15)`.
Prints wall time for all requests and model calls, for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runner import compare, machine, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=Path("build/minilm"))
    parser.add_argument("--feeds", type=Path, default=Path("samples/minilm/evaluation.npz"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from tensorsmith.runtime import DynamicBatcher, load

    with np.load(args.feeds) as archive:
        rows = {name: archive[name] for name in archive.files}
    requests = [{name: array[i % len(array)][None] for name, array in rows.items()} for i in range(args.requests)]
    model = load(args.artifact)
    calls: list[int] = []

    def unbatched() -> None:
        for feeds in requests:
            model.run(feeds)

    def batched() -> None:
        batcher = DynamicBatcher(model, max_batch=32, max_delay_ms=15)

        async def all_at_once() -> None:
            await asyncio.gather(*(batcher.run(feeds) for feeds in requests))

        asyncio.run(all_at_once())
        calls.append(batcher.stats.model_calls)

    timings, ratios = compare({"one call per request": unbatched, "DynamicBatcher": batched},
                              repeats=args.repeats, warmup=1)  # fmt: skip
    print(f"{machine()}; MiniLM ({model.backend}), {args.requests} concurrent requests × 1 sentence × 64 tokens\n")
    table = [
        ["one call per request", timings["one call per request"].summary(), args.requests, "1.00"],
        [
            "DynamicBatcher(32, 15 ms)",
            timings["DynamicBatcher"].summary(),
            max(calls),
            f"{ratios['DynamicBatcher']:.2f}",
        ],
    ]
    print(markdown_table(["serving", "ms for all requests min / median / max", "model calls", "ratio"], table))
    model.close()


if __name__ == "__main__":
    main()
