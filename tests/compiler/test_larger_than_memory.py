"""Checkpoints larger than the machine: a decoder exported without a float32 module (its weights read from the
checkpoint one tensor at a time), a compile that cannot fit refused before any work, damaged shards and weights
named in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.compiler import CompileConfig, compile, resources
from tensorsmith.compiler.frontend import export
from tensorsmith.compiler.frontend.fused import verify
from tensorsmith.compiler.resources import check_resources, estimate
from tensorsmith.compiler.variants.plan import plan_variants
from tensorsmith.core import ir, memory
from tensorsmith.core.errors import ConfigError, ExportError, VerificationError
from tensorsmith.runtime import load
from tensorsmith.runtime.errors import ArtifactError

LLAMA = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "num_attention_heads": 4, "num_key_value_heads": 2}


def _llama(directory: Path, layers: int, hidden: int = 64, intermediate: int = 128, vocab: int = 256) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      vocab_size=vocab, **LLAMA)  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_a_decoder_exports_and_verifies_without_loading_its_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamped export never builds the float32 module (build_module would load every weight), and the
    compiled artifact still generates transformers' tokens."""
    import transformers

    checkpoint = _llama(tmp_path / "checkpoint", layers=4)

    def refused(*_: object) -> None:
        raise AssertionError("the whole module was loaded")

    monkeypatch.setattr(export, "build_module", refused)
    result = compile(CompileConfig.create({"source": str(checkpoint), "targets": ["cpu"]}), tmp_path / "out")
    assert result.manifest.source.traced_layers == 2
    prompt = np.array([[5, 9, 17, 33, 2, 71]], np.int64)
    reference = transformers.LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    expected = reference.generate(torch.from_numpy(prompt), max_new_tokens=8, do_sample=False)
    with load(tmp_path / "out") as model:
        assert model.generate(prompt, max_new_tokens=8).tolist() == expected.tolist()


COMPILE_PEAK = """
import json, sys
from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.core import ir

ir.EXTERNAL_DATA_ABOVE = 1 << 20  # every graph's weights beside it, as a large model's are (inline below 128 MB)
config = {"source": sys.argv[1], "targets": ["cpu"], "precision": "int4", "int4_algorithm": "rtn",
          "layerwise": "always", "check_resources": False}
result = compile(CompileConfig.create(config), sys.argv[2])
steps = {step.name.split(":")[0]: step.peak_rss_bytes for step in result.manifest.steps}
print(json.dumps(steps))
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


@pytest.mark.slow
def test_the_compile_s_peak_does_not_grow_with_the_layers(tmp_path: Path) -> None:
    """The bound for a whole INT4 compile (the export and its reference's run, verification, the variant written
    and measured, the cpu's choices, the generation graph), each in its own process: 12 layers peak less than one
    layer's float32 weights + 64 MB above 4 layers. The module is never loaded, the graphs are measured a layer at
    a time and the INT4 codes written a block of rows at a time; a stage that holds every layer again (transformers'
    float32 module: 8 more layers are 503 MB) fails here."""
    peaks, steps = {}, {}
    for layers in (4, 12):
        checkpoint = _llama(tmp_path / f"l{layers}", layers=layers, hidden=1024, intermediate=4096)
        run = subprocess.run([sys.executable, "-c", COMPILE_PEAK, str(checkpoint), str(tmp_path / f"o{layers}")],
                             capture_output=True, text=True, check=True)  # fmt: skip
        *_, by_step, peak = run.stdout.strip().splitlines()
        peaks[layers], steps[layers] = int(peak), json.loads(by_step)
    layer_fp32 = 4 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 4096)
    assert peaks[12] - peaks[4] < layer_fp32 + (64 << 20), (peaks, steps)


def _sparse_safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A bf16 safetensors file of these shapes whose data is a hole: its header is real, its bytes take no disk."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape in tensors.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        file.truncate(8 + len(text) + offset)


def _eight_billion(directory: Path, shards: int = 4) -> Path:
    """A checkpoint of Llama-3.1-8B's shapes (32 layers, hidden 4096, vocabulary 128256) as sparse files; with
    more shards, 8 more such layers each."""
    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 8 * shards, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "dtype": "bfloat16"}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for shard in range(shards):
        tensors = {}
        for layer in range(8 * shard, 8 * shard + 8):
            prefix = f"model.layers.{layer}."
            tensors.update({f"{prefix}self_attn.q_proj.weight": [4096, 4096],
                            f"{prefix}self_attn.k_proj.weight": [1024, 4096],
                            f"{prefix}self_attn.v_proj.weight": [1024, 4096],
                            f"{prefix}self_attn.o_proj.weight": [4096, 4096],
                            f"{prefix}mlp.gate_proj.weight": [14336, 4096],
                            f"{prefix}mlp.up_proj.weight": [14336, 4096],
                            f"{prefix}mlp.down_proj.weight": [4096, 14336],
                            f"{prefix}input_layernorm.weight": [4096],
                            f"{prefix}post_attention_layernorm.weight": [4096]})  # fmt: skip
        if shard == shards - 1:
            tensors.update({"model.embed_tokens.weight": [128256, 4096], "lm_head.weight": [128256, 4096],
                            "model.norm.weight": [4096]})  # fmt: skip
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        _sparse_safetensors(directory / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def test_a_checkpoint_larger_than_the_machine_is_refused_before_any_work(tmp_path: Path) -> None:
    """256 layers of Llama-3.1-8B's shape (57B parameters: more than any CI machine's memory as the compile holds
    them today): one line with the figures and what fits, exit status 1, nothing written (the estimate reads the
    shards' headers only)."""
    checkpoint = _eight_billion(tmp_path / "llama-56b", shards=32)
    flags = ["--precision", "int4", "--int4-algorithm", "rtn", "--target", "cpu", "--target", "sm_86"]
    command = [sys.executable, "-m", "tensorsmith.cli.main", "compile", str(checkpoint), "-o", str(tmp_path / "out")]
    run = subprocess.run([*command, *flags], capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    first = run.stderr.strip().splitlines()[0]
    assert "56.89B parameters (int4 for cpu, sm_86) needs about" in first and "GB of memory" in first, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "hint: this machine's memory holds decoders up to" in first
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.partial*"))


def test_the_estimate_grows_with_the_parameters_and_the_plan(tmp_path: Path) -> None:
    checkpoint = _eight_billion(tmp_path / "llama-8b")
    config = {"source": str(checkpoint), "precision": "int4", "int4_algorithm": "rtn"}
    both = estimate(checkpoint, plan_variants(CompileConfig.create({**config, "targets": ["cpu", "sm_86"]}), True),
                    tmp_path / "out", search=False)  # fmt: skip
    gpu = estimate(checkpoint, plan_variants(CompileConfig.create({**config, "targets": ["sm_86"]}), True),
                   tmp_path / "out", search=False)  # fmt: skip
    assert both.parameters == gpu.parameters == 8_030_261_248
    # a variant less; no float32 graph on disk: run a layer at a time, it refers to the checkpoint's bytes
    assert both.disk > gpu.disk > both.parameters and both.disk < 4 * both.parameters
    # no stage holds the model: the sm_86 engine's build from its INT4 variant is the peak (resources.py)
    assert both.memory == gpu.memory < 2 * both.parameters
    with pytest.MonkeyPatch.context() as patch:  # an 8 GB machine with room on its disk: the memory is short
        patch.setattr(resources, "available_memory", lambda: 8 * 10**9)
        patch.setattr(resources, "free_disk", lambda path: 10**12)
        with pytest.raises(ConfigError, match=r"8.03B parameters \(int4 for cpu, sm_86\) needs about 9.7 GB of mem"):
            check_resources(checkpoint, plan_variants(CompileConfig.create({**config, "targets": ["cpu", "sm_86"]}),
                                                      True), tmp_path / "out", search=False)  # fmt: skip


def test_a_container_s_memory_limit_counts_and_its_page_cache_does_not(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("8000000000\n")
    (tmp_path / "memory.current").write_text("5000000000\n")
    (tmp_path / "memory.stat").write_text("anon 1000000000\nfile 4000000000\n")
    assert memory.cgroup_memory_left(tmp_path) == 7_000_000_000  # 8 GB less 1 GB held (4 GB is page cache)
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.cgroup_memory_left(tmp_path) is None


def test_a_shard_missing_or_cut_short_is_named(tmp_path: Path) -> None:
    checkpoint = _eight_billion(tmp_path / "llama-8b")
    config = {"source": str(checkpoint), "check_resources": False}
    shard = checkpoint / "model-00002-of-00004.safetensors"
    with shard.open("r+b") as file:
        file.truncate(shard.stat().st_size - 4096)
    with pytest.raises(ConfigError, match=r"model-00002-of-00004.safetensors is truncated or damaged"):
        compile(CompileConfig.create(config), tmp_path / "out")
    shard.unlink()
    with pytest.raises(ConfigError, match=r"names model-00002-of-00004.safetensors for 72 tensors, and .* not exist"):
        compile(CompileConfig.create(config), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_weights_holding_nan_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    """4 KB of 0xFF in a weight (2,048 bf16 NaNs) is refused as the tensor is read, naming it."""
    from safetensors import safe_open

    checkpoint = _llama(tmp_path / "checkpoint", layers=4, hidden=64, intermediate=128)
    path = checkpoint / "model.safetensors"
    with safe_open(str(path), framework="pt") as opened:
        names = list(opened.keys())
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_length])
    name = "model.layers.2.mlp.up_proj.weight"
    assert name in names
    start = 8 + header_length + header[name]["data_offsets"][0]
    with path.open("r+b") as file:
        file.seek(start)
        file.write(b"\xff" * 4096)
    with pytest.raises(ExportError, match=rf"{name} in .*model.safetensors holds 2048 NaN or infinite values"):
        compile(CompileConfig.create({"source": str(checkpoint), "targets": ["cpu"]}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_verification_whose_error_is_nan_fails() -> None:
    config = CompileConfig.create({"source": "model.onnx"})
    reference = [np.ones((2, 3), np.float32)]
    with pytest.raises(VerificationError, match="not finite"):
        verify(config, ["logits"], reference, [np.full((2, 3), np.nan, np.float32)])
    masked = np.array([[0.5, -np.inf, 2.0]], np.float32)  # the same -inf on both sides (a mask) is no error
    verify(config, ["logits"], [masked], [masked + np.float32(1e-7)])
    with pytest.raises(VerificationError, match="not finite"):  # NaN on both sides is still one
        verify(config, ["logits"], [np.full((2, 3), np.nan, np.float32)], [np.full((2, 3), np.nan, np.float32)])


@pytest.mark.slow
def test_a_disk_that_fills_up_mid_compile_is_one_line_and_nothing_is_left(tmp_path: Path) -> None:
    """A write refused mid-compile (here a file size limit: EFBIG, as ENOSPC would be) names the file in one line,
    exits 1, and leaves neither the artifact nor its staging directory."""
    import resource
    import signal

    checkpoint = _llama(tmp_path / "checkpoint", layers=4)

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = tmp_path / "artifacts" / "tiny"
    command = [sys.executable, "-m", "tensorsmith.cli.main", "compile", str(checkpoint), "-o", str(out)]
    run = subprocess.run([*command, "--target", "cpu"], capture_output=True, text=True, preexec_fn=limited)
    assert run.returncode == 1, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]  # the rest: progress lines
    assert len(lines) == 1 and lines[0].startswith(f"error: writing {out}/"), run.stderr
    assert "File too large" in lines[0] and f"nothing was written to {out}" in lines[0]
    assert not out.exists() and list(out.parent.iterdir()) == []


@pytest.mark.slow
def test_a_large_decoder_s_artifact_holds_what_its_targets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No target runs the fp32 reference: it is measured, recorded as not shipped, and left out (at 8B it is 32 GB,
    at 14B 59 GB). The runtime's fallback on a machine without the GPU is the cpu target's
    variant, and a GPU-only one has none: it says so. (Small models keep it: a toy's reference costs nothing.)"""
    checkpoint = _llama(tmp_path / "checkpoint", layers=4, vocab=320)  # not the export cache's other 4-layer entry
    int4 = {"source": str(checkpoint), "precision": "int4", "int4_algorithm": "rtn"}
    monkeypatch.setattr(ir, "EXTERNAL_DATA_ABOVE", 0)  # a large decoder's: its weights outside its graph files
    result = compile(CompileConfig.create({**int4, "targets": ["cpu", "sm_86"]}), tmp_path / "both")
    reference = result.manifest.variants[0]
    assert result.manifest.model is None and not reference.shipped and reference.accuracy["max_relative_error"] < 1e-4
    assert not list((tmp_path / "both").glob("model.onnx*"))
    with load(tmp_path / "both") as model:
        assert model.generate(np.array([[5, 9, 17]], np.int64), max_new_tokens=4).shape == (1, 7)
    gpu_only = compile(CompileConfig.create({**int4, "targets": ["sm_86"]}), tmp_path / "gpu")
    assert gpu_only.manifest.model is None and not list((tmp_path / "gpu").glob("model.onnx*"))
    with pytest.raises(ArtifactError, match="neither a cpu target nor the fp32 reference graph"):
        load(tmp_path / "gpu")  # no GPU here, and nothing left to run without one
    assert plan_variants(CompileConfig.create({**int4, "targets": ["cpu"], "precision": "fp32"})).ships_reference


def test_a_mixture_whose_experts_load_converted_is_estimated_whole(tmp_path: Path) -> None:
    """transformers stacks a mixture's experts from one checkpoint tensor each as it loads them: such a decoder is
    loaded whole as float32 (stamped_export.py), so its estimate counts the module, and a machine too small for
    that refuses it in one line before any work (DeepSeek-V2-Lite's first 5 layers, 2.84B parameters, were killed
    by the kernel at 23 GB in the graph passes while the estimate assumed streamed weights)."""
    from tensorsmith.compiler.frontend.huggingface import read_model_directory
    from tensorsmith.compiler.frontend.stamped_export import streams_weights
    from tests.families import save_family

    save_family("qwen2_moe", tmp_path / "moe", num_hidden_layers=4)
    dense = _llama(tmp_path / "llama", layers=4)
    config = CompileConfig.create({"source": str(tmp_path / "moe"), "targets": ["cpu"]})
    assert not streams_weights(read_model_directory(tmp_path / "moe"), config)
    assert streams_weights(read_model_directory(dense), config.model_copy(update={"source": str(dense)}))
    plan = plan_variants(config, True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resources, "available_memory", lambda: 10**6)
        with pytest.raises(ConfigError, match="needs about") as caught:
            check_resources(tmp_path / "moe", plan, tmp_path / "out", search=False, streamed=False)
    assert "loaded whole as float32, not read from the checkpoint tensor by tensor" in str(caught.value.hint)
    whole = resources.estimate(tmp_path / "moe", plan, tmp_path / "out", search=False, streamed=False)
    # compiled to fp32 alone, its exported graph is the variant: twice its fp32 bytes (V2-Lite's 4 layers: 1.47x)
    assert whole.memory == resources.BASE_MEMORY + 2 * 4 * whole.parameters
