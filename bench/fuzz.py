"""A mutation fuzzer over ONNX protobufs for the runtime loader: every damaged model must load and run, or fail
with a TensorsmithError; anything else (another exception, a crash) is a bug.

    python bench/fuzz.py [--cases 5000] [--seed 0] [--artifact DIR]

Each case damages the artifact's model.onnx, either as bytes (bit flips, overwritten, inserted or cut runs,
truncation) or as a parsed model (an op renamed, a node dropped, an input rewired, an initializer's dims or dtype
changed, the opset moved), records the new sha256 in the manifest so the file reaches ONNX Runtime, then calls
`load()` and `run()`. Cases run in worker processes, so a crash in native code is counted, not fatal.
Prints a summary table for docs/benchmarks.md; exits 1 on any unexpected outcome. The tests run a few hundred
cases in-process (tests/runtime/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MUTATIONS_PER_CASE = (1, 4)


def _byte_mutation(data: bytes, rng: np.random.Generator) -> bytes:
    buffer = bytearray(data)
    kind = rng.integers(0, 5)
    position = int(rng.integers(0, max(len(buffer), 1)))
    if kind == 0:  # flip one bit
        buffer[position] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # overwrite a short run
        run = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        buffer[position : position + len(run)] = run
    elif kind == 2:  # insert a short run
        buffer[position:position] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
    elif kind == 3:  # cut a run
        del buffer[position : position + int(rng.integers(1, 64))]
    else:  # truncate
        del buffer[position:]
    return bytes(buffer)


def _model_mutation(data: bytes, rng: np.random.Generator) -> bytes:
    import onnx

    model = onnx.load_from_string(data)
    graph = model.graph
    kind = int(rng.integers(0, 7))
    nodes = list(graph.node)
    if kind == 0 and nodes:  # rename an op to another real one, or to nonsense
        node = nodes[int(rng.integers(0, len(nodes)))]
        node.op_type = str(rng.choice(["Relu", "MatMul", "Add", "Softmax", "Gelu", "Frobnicate", ""]))
    elif kind == 1 and nodes:  # drop a node
        del graph.node[int(rng.integers(0, len(nodes)))]
    elif kind == 2 and nodes:  # rewire an input to another tensor (or to nothing)
        node = nodes[int(rng.integers(0, len(nodes)))]
        if node.input:
            names = [n for other in nodes for n in other.output] + [i.name for i in graph.input] + ["missing"]
            node.input[int(rng.integers(0, len(node.input)))] = str(rng.choice(names))
    elif kind == 3 and graph.initializer:  # change an initializer's dims
        tensor = graph.initializer[int(rng.integers(0, len(graph.initializer)))]
        if tensor.dims:
            tensor.dims[int(rng.integers(0, len(tensor.dims)))] = int(rng.integers(0, 40))
    elif kind == 4 and graph.initializer:  # change an initializer's dtype
        tensor = graph.initializer[int(rng.integers(0, len(graph.initializer)))]
        tensor.data_type = int(rng.integers(0, 25))
    elif kind == 5:  # move the opset
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = int(rng.integers(1, 40))
    elif nodes:  # set or break an attribute
        node = nodes[int(rng.integers(0, len(nodes)))]
        node.attribute.append(onnx.helper.make_attribute(str(rng.choice(["axis", "alpha", "perm"])), -7))
    return model.SerializeToString()


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """One fuzz case: a few byte or model-level mutations of `data`."""
    for _ in range(int(rng.integers(*MUTATIONS_PER_CASE))):
        if rng.random() < 0.5:
            data = _byte_mutation(data, rng)
        else:
            try:
                data = _model_mutation(data, rng)
            except Exception:  # already unparseable: keep damaging bytes
                data = _byte_mutation(data, rng)
    return data


def run_case(artifact: Path, original: bytes, seed: int, feeds: dict[str, np.ndarray]) -> str:
    """Damage model.onnx with case `seed`, then load and run: the outcome's name ("ran" or the error type).
    Raises whatever is not a TensorsmithError."""
    from tensorsmith.runtime import TensorsmithError, load

    damaged = mutate(original, np.random.default_rng(seed))
    manifest_path = artifact / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    (artifact / manifest["model"]["path"]).write_bytes(damaged)
    digest = hashlib.sha256(damaged).hexdigest()
    manifest["model"]["sha256"] = digest
    for variant in manifest["variants"]:
        if variant["path"] == manifest["model"]["path"]:
            variant["sha256"] = digest
    manifest_path.write_text(json.dumps(manifest))
    try:
        with load(artifact, backend="onnxruntime") as model:
            model.run(feeds)
        return "ran"
    except TensorsmithError as err:
        return type(err).__name__


def fuzz(artifact: Path, cases: range, feeds: dict[str, np.ndarray]) -> tuple[collections.Counter[str], list[str]]:
    """Run `cases` in this process on a scratch copy of `artifact`: (outcomes, unexpected exceptions)."""
    outcomes: collections.Counter[str] = collections.Counter()
    unexpected: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tensorsmith-fuzz-") as scratch:
        copy = Path(shutil.copytree(artifact, Path(scratch) / "artifact"))
        original = (artifact / "model.onnx").read_bytes()
        for seed in cases:
            try:
                outcomes[run_case(copy, original, seed, feeds)] += 1
            except Exception as err:
                outcomes["unexpected"] += 1
                unexpected.append(f"case {seed}: {type(err).__name__}: {str(err)[:200]}")
    return outcomes, unexpected


def compile_fuzz_artifact(directory: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A small real model (an MLP exported by torch) compiled by tensorsmith, and feeds for it."""
    from tensorsmith.compiler import CompileConfig, compile
    from tests.conftest import small_mlp_onnx

    source = small_mlp_onnx(directory / "mlp.onnx")
    config = CompileConfig.create(
        {"source": str(source), "inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 8]}]}
    )
    artifact = compile(config, directory / "artifact").out
    return artifact, {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}


def _worker(arguments: list[str]) -> None:
    """`fuzz.py --worker ARTIFACT START STOP`: one chunk, the result as JSON on stdout."""
    artifact, start, stop = Path(arguments[0]), int(arguments[1]), int(arguments[2])
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}
    outcomes, unexpected = fuzz(artifact, range(start, stop), feeds)
    print(json.dumps({"outcomes": outcomes, "unexpected": unexpected}))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0, help="first case number")
    parser.add_argument("--chunk", type=int, default=250, help="cases per worker process")
    args = parser.parse_args()

    from bench.runner import machine

    started = time.perf_counter()
    outcomes: collections.Counter[str] = collections.Counter()
    unexpected: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tensorsmith-fuzz-") as scratch:
        artifact, _ = compile_fuzz_artifact(Path(scratch))
        for start in range(args.seed, args.seed + args.cases, args.chunk):
            stop = min(start + args.chunk, args.seed + args.cases)
            done = _run_worker(artifact, start, stop)
            if done.returncode != 0:  # a crash in native code: the chunk's cases are re-run one by one
                outcomes.update(_bisect_crash(artifact, start, stop, unexpected))
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            outcomes.update(result["outcomes"])
            unexpected += result["unexpected"]
    seconds = time.perf_counter() - started
    print(f"{machine()}; {args.cases} mutated ONNX models through load() + run(), {seconds:.0f} s\n")
    print("| outcome | cases |\n|---|---|")
    for name, count in sorted(outcomes.items(), key=lambda item: -item[1]):
        print(f"| {name} | {count} |")
    for line in unexpected[:20]:
        print(line)
    sys.exit(1 if unexpected or outcomes.get("crash") else 0)


def _run_worker(artifact: Path, start: int, stop: int) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, __file__, "--worker", str(artifact), str(start), str(stop)]
    return subprocess.run(command, capture_output=True, text=True)


def _bisect_crash(artifact: Path, start: int, stop: int, unexpected: list[str]) -> collections.Counter[str]:
    outcomes: collections.Counter[str] = collections.Counter()
    for seed in range(start, stop):
        done = _run_worker(artifact, seed, seed + 1)
        if done.returncode != 0:
            outcomes["crash"] += 1
            unexpected.append(f"case {seed}: the process died (exit {done.returncode})")
        else:
            result = json.loads(done.stdout.strip().splitlines()[-1])
            outcomes.update(result["outcomes"])
            unexpected += result["unexpected"]
    return outcomes


if __name__ == "__main__":
    main()
