"""INT4 weight-only on one checkpoint (samples/tinylm) and the same held-out text, one run: tensorsmith (rtn, awq,
and `auto` under 'perplexity-ratio<=1.03')
against TensorRT Model Optimizer's ONNX int4 (awq_lite, awq_clip), ONNX Runtime's MatMulNBits quantizer (RTN,
HQQ, GPTQ) and ONNX Runtime GenAI's model builder `-p int4`.

Every quantizer runs as its own process (wall clock including imports, peak RSS); Model Optimizer and ONNX
Runtime's quantizer start from tensorsmith's fp32 graph (same inputs and outputs) and calibrate, where they do,
on the same 32 windows of pydoc_data.topics text as tensorsmith's AWQ. Per side: perplexity ratio over the fp32
graph and next-token agreement on 8 held-out windows of 128 tokens, file MB, CPU decode tokens/s at batch 1 (64
new tokens after a 128-token prompt, median of 3; the same generation loop for every graph with tensorsmith's
inputs, og.Generator for GenAI's), and whether standalone TensorRT for RTX builds the graph for sm_86.

    bash bench/modelopt-site.sh && .venv/bin/python bench/int4.py     # the Markdown table for docs/benchmarks.md
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import CHECKPOINT, HELDOUT, ROOT, _builds, _process, _timed, prompts

MODELOPT_SITE = ROOT / "build" / "modelopt-site"
WINDOWS, WINDOW, CALIBRATION_WINDOWS, NEW_TOKENS, RUNS = 64, 128, 32, 64, 3


def windows(path: Path, count: int) -> np.ndarray:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(path.read_text()).ids
    return np.array(ids[: count * WINDOW], np.int64).reshape(count, WINDOW)


def prefill_feeds(tokens: np.ndarray, layout: dict[str, int]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
             "position_ids": np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).copy()}  # fmt: skip
    for i in range(layout["layers"]):
        for kind in ("key", "value"):
            empty = np.zeros((len(tokens), layout["kv_heads"], 0, layout["head_dim"]), np.float32)
            feeds[f"past_key_values.{i}.{kind}"] = empty
    return feeds


def quantize(side: str, fp32: str, output: str, calibration: str, layout: str) -> None:
    """In the side's own process: write `output` from the fp32 graph."""
    if side.startswith("modelopt"):
        sys.path.append(str(MODELOPT_SITE))  # after .venv's: its onnx and onnxruntime are the ones used
        from modelopt.onnx.quantization import quantize as modelopt_quantize

        data = prefill_feeds(np.load(calibration)["input_ids"], json.loads(layout))
        modelopt_quantize(fp32, quantize_mode="int4", calibration_method=side.split(":")[1], calibration_data=data,
                          calibration_eps=["cpu"], output_path=output, block_size=128, log_level="WARNING")  # fmt: skip
        return
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    algorithm = side.split(":")[1]
    if algorithm == "RTN":
        config: Any = nbits.RTNWeightOnlyQuantConfig()
    elif algorithm == "HQQ":
        config = nbits.HQQWeightOnlyQuantConfig(block_size=128, bits=4)
    else:
        tokens = np.load(calibration)["input_ids"]
        feeds = [prefill_feeds(tokens[i : i + 1], json.loads(layout)) for i in range(len(tokens))]

        from onnxruntime.quantization import CalibrationDataReader

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.items = iter(feeds)

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.items, None)

        config = nbits.GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(), block_size=128)
    quantizer = nbits.MatMulNBitsQuantizer(onnx.load(fp32), block_size=128, is_symmetric=True, algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(output, use_external_data_format=False)


def measure(side: str, path: str, layout: str, out: str) -> None:
    """In its own process: the logits of the held-out windows, and decode tokens/s at batch 1."""
    tokens = windows(HELDOUT, WINDOWS)
    shape = json.loads(layout)
    if side == "onnxruntime-genai":
        import onnxruntime_genai as og

        model = og.Model(path)
        logits = []
        for row in tokens:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=WINDOW + 1)
            generator = og.Generator(model, params)
            generator.append_tokens(row[None].astype(np.int32))
            logits.append(np.asarray(generator.get_output("logits"))[0])
        from generate import side_genai

        generate = side_genai(path)
    else:
        from tensorsmith.core.timing import cpu_session
        from tensorsmith.runtime.generation import Generator
        from tensorsmith.runtime.generation_request import Request
        from tensorsmith.runtime.kv_cache import CacheShape, DynamicCacheSession
        from tensorsmith.runtime.manifest import GenerationRecord
        from tensorsmith.runtime.sampling import Sampling

        session = cpu_session(Path(path))
        names = [output.name for output in session.get_outputs()]
        logits = list(session.run(["logits"], prefill_feeds(tokens, shape))[0])
        record = GenerationRecord(layers=shape["layers"], kv_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                                  max_sequence_length=512)  # fmt: skip

        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return dict(zip(names, session.run(None, feeds), strict=True))

        def open_cache(rows: int, capacity: int) -> DynamicCacheSession:
            return DynamicCacheSession(run, CacheShape(record, rows, capacity, np.dtype("float32")))

        def generate(batch: np.ndarray, stamp: Any) -> np.ndarray:
            request = Request(record, batch, np.ones_like(batch), NEW_TOKENS, Sampling(), 1, [], 0, None)
            return Generator(open_cache).generate(request, lambda _: stamp())

    prompt = prompts()[:1]
    _timed(generate, prompt)
    rate = statistics.median(_timed(generate, prompt)[1] for _ in range(RUNS))
    np.savez(out, logits=np.stack(logits).astype(np.float32), rate=np.array(rate))


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "quantize":
        quantize(*sys.argv[2:])
        return
    if len(sys.argv) == 6 and sys.argv[1] == "measure":
        measure(*sys.argv[2:])
        return
    run()


def run() -> None:
    from tensorsmith.core.language import language_model_metrics

    python, tensorsmith = sys.executable, str(Path(sys.executable).with_name("tensorsmith"))
    with tempfile.TemporaryDirectory(prefix="tensorsmith-int4-") as scratch:
        work = Path(scratch)
        calibration_text = work / "calibration.txt"
        import pydoc_data.topics

        calibration_text.write_text("\n".join(list(pydoc_data.topics.topics.values())[:60]), encoding="utf-8")
        np.savez(work / "calibration.npz", input_ids=windows(calibration_text, CALIBRATION_WINDOWS))
        common = ["--target", "cpu", "--target", "sm_86", "--eval-data", str(HELDOUT)]
        made: dict[str, tuple[float, float, int]] = {}
        # fp32 with a GPU target: standard ops only (no Attention node), the graph any exporter gives the anchors
        reference_compile = [tensorsmith, "compile", str(CHECKPOINT), "-o", str(work / "fp32"), "--precision", "fp32"]
        made["fp32 (reference)"] = _process([*reference_compile, "--target", "cpu", "--target", "sm_86"])
        manifest = json.loads((work / "fp32" / "manifest.json").read_text())
        layout = json.dumps({key: manifest["generation"][key] for key in ("layers", "kv_heads", "head_dim")})
        fp32 = work / "fp32" / "model.onnx"
        graphs: dict[str, Path] = {"fp32 (reference)": fp32}
        for algorithm, block in (("rtn", 128), ("awq", 128), ("awq", 64), ("awq", 32)):
            name, folder = f"tensorsmith int4 {algorithm} block {block}", work / f"{algorithm}{block}"
            made[name] = _process([tensorsmith, "compile", str(CHECKPOINT), "-o", str(folder), *common,
                                   "--precision", "int4", "--int4-algorithm", algorithm, "--int4-block-size",
                                   str(block), "--calibration", str(calibration_text), "--calibration-samples",
                                   "32"])  # fmt: skip
            graphs[name] = folder / "variants" / "int4.onnx"
            graphs[f"{name} (cpu variant)"] = folder / "variants" / "cpu-int4.onnx"
        name = "tensorsmith auto perplexity-ratio<=1.03 block 128"
        made[name] = _process([tensorsmith, "compile", str(CHECKPOINT), "-o", str(work / "auto128"), *common,
                               "--precision", "auto", "--budget", "perplexity-ratio<=1.03", "--calibration",
                               str(calibration_text), "--calibration-samples", "32"])  # fmt: skip
        graphs[name] = work / "auto128" / "variants" / "int4.onnx"
        graphs[f"{name} (cpu variant)"] = work / "auto128" / "variants" / "cpu-int4.onnx"
        name = "tensorsmith auto perplexity-ratio<=1.03 block 128, targets sm_89 + sm_120 (fp8 a candidate)"
        made[name] = _process([tensorsmith, "compile", str(CHECKPOINT), "-o", str(work / "auto-ada"), "--target",
                               "sm_89", "--target", "sm_120", "--eval-data", str(HELDOUT), "--precision", "auto",
                               "--budget", "perplexity-ratio<=1.03", "--calibration", str(calibration_text),
                               "--calibration-samples", "32"])  # fmt: skip
        graphs[name] = work / "auto-ada" / "variants" / "int4.onnx"
        anchors = ["onnxruntime:RTN", "onnxruntime:HQQ", "onnxruntime:GPTQ"]
        if MODELOPT_SITE.is_dir():
            anchors = ["modelopt:awq_lite", "modelopt:awq_clip", *anchors]
        for side in anchors:
            output = work / f"{side.replace(':', '-')}.onnx"
            made[side] = _process([python, __file__, "quantize", side, str(fp32), str(output),
                                   str(work / "calibration.npz"), layout])  # fmt: skip
            graphs[side] = output
        made["onnxruntime-genai -p int4"] = _process([python, "-m", "onnxruntime_genai.models.builder", "-i",
                                                     str(CHECKPOINT), "-o", str(work / "genai"), "-p", "int4", "-e",
                                                     "cpu", "-c", str(work / "cache")])  # fmt: skip
        graphs["onnxruntime-genai -p int4"] = work / "genai" / "model.onnx"

        tokens = windows(HELDOUT, WINDOWS)
        results: dict[str, dict[str, Any]] = {}
        for name, path in graphs.items():
            if not path.is_file():
                results[name] = {"missing": True}
                continue
            side = "onnxruntime-genai" if "genai" in name else "onnx"
            measured = work / f"{len(results)}.npz"
            where = str(path.parent if side == "onnxruntime-genai" else path)
            code = subprocess.call([python, __file__, "measure", side, where, layout, str(measured)])
            if code:
                results[name] = {"missing": True}
                continue
            with np.load(measured) as archive:
                results[name] = {"logits": archive["logits"], "rate": float(archive["rate"]),
                                 "mb": sum(f.stat().st_size for f in _files(path)) / 1e6,
                                 "engine": _engine(path, work, name)}  # fmt: skip
        reference = results["fp32 (reference)"]["logits"]
        print("| side | perplexity ratio | next-token agreement | file MB | CPU decode tok/s (batch 1) | "
              "quantizing (wall s, peak RSS) | TensorRT for RTX, sm_86 |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for name, figures in results.items():
            if figures.get("missing"):
                print(f"| {name} | failed | | | | {made.get(name)} | |")
                continue
            metrics = language_model_metrics(tokens, reference, figures["logits"])
            wall, rss, code = made.get(name, (0.0, 0.0, 0))
            print(f"| {name} | {metrics['perplexity-ratio']:.4f} | {metrics['next-token-agreement']:.3f} | "
                  f"{figures['mb']:.2f} | {figures['rate']:.0f} | {wall:.1f} s, {rss:.0f} MB (exit {code}) | "
                  f"{figures['engine']} |")  # fmt: skip


def _files(path: Path) -> list[Path]:
    """The graph and its external data, if any (GenAI writes model.onnx.data)."""
    return [path, *(p for p in path.parent.glob(path.name + ".data"))]


def _engine(path: Path, work: Path, name: str) -> str:
    """Whether TensorRT for RTX builds the graph for sm_86 (tensorsmith's own: the compile built it; sm_89 and
    sm_120 where those are its targets)."""
    if name.startswith("tensorsmith") and "cpu variant" not in name:
        manifest = json.loads((path.parent.parent / "manifest.json").read_text())  # OUT/variants/int4.onnx
        built = [f"{t['name']} {t['status']}" for t in manifest["targets"] if t["name"] != "cpu"]
        profiles = next((t.get("engine") or {}).get("profile_names") for t in manifest["targets"] if t["name"] != "cpu")
        return f"{', '.join(built)} by the compile (profiles {profiles})"
    if "cpu variant" in name or "reference" in name:
        return "—"
    if "genai" in name:
        return _builds(path)
    return _builds_decoder(path, work)


def _builds_decoder(path: Path, work: Path) -> str:
    """Build with the prefill/decode profiles tensorsmith's own sm_86 engine has."""
    from tensorsmith.compiler.engines.builder import build_engine
    from tensorsmith.compiler.engines.profiles import Profile
    from tensorsmith.core.errors import BuildError

    manifest = json.loads((work / "awq128" / "manifest.json").read_text())
    target = next(t for t in manifest["targets"] if t["name"] == "sm_86")
    profiles = [Profile({k: (tuple(v["min"]), tuple(v["opt"]), tuple(v["max"])) for k, v in p.items()})
                for p in target["engine"]["profiles"]]  # fmt: skip
    try:
        build_engine(path, "sm_86", profiles)
        return "builds"
    except BuildError as err:
        return f"does not build: {err.message[:160]}"


if __name__ == "__main__":
    main()
