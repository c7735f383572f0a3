"""Gated DeltaNet (Qwen3.5/3.6's linear attention) beside full attention: a tiny Qwen3.5 checkpoint compiles with
each linear-attention layer's conv and recurrent states in the cache, generates transformers' greedy tokens over
the static cache (states swapped in place of keys and values), keeps its recurrence in fp32 in the fp16 variant,
and builds fp16 engines for SM86 and SM120, which the runtime does not select yet (it does not carry the states)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.delta_rule import gated_delta_rule
from tensorsmith.runtime import load
from tensorsmith.runtime.device import Device
from tensorsmith.runtime.manifest import read_manifest
from tensorsmith.runtime.selection import select_engine
from tests.compiler.test_decoders import assert_greedy_tokens_match
from tests.families import save_family


@pytest.mark.parametrize("length", [1, 20, 64, 130])  # one token, one chunk, a full chunk, three (the last padded)
def test_the_chunked_rule_is_transformers_chunked_and_recurrent_rules(length: int) -> None:
    torch.manual_seed(0)
    batch, key_heads, value_heads, key_dim, value_dim = 2, 2, 4, 16, 8
    q, k = torch.randn(batch, length, key_heads, key_dim), torch.randn(batch, length, key_heads, key_dim)
    v = torch.randn(batch, length, value_heads, value_dim)
    g, beta = -torch.rand(batch, length, value_heads), torch.rand(batch, length, value_heads)
    state = torch.randn(batch, value_heads, key_dim, value_dim)
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    for rule in (modeling_qwen3_5.torch_chunk_gated_delta_rule, modeling_qwen3_5.torch_recurrent_gated_delta_rule):
        q_v, k_v = (t.repeat_interleave(value_heads // key_heads, dim=2) for t in (q, k))
        expected, expected_final = rule(q_v, k_v, v, g=g, beta=beta, initial_state=state.clone(),
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(final, expected_final, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("qwen3_5") / "checkpoint"
    # as many key heads as value heads, as Qwen3.5's small models have (the sweep's checkpoint groups them)
    return directory, save_family("qwen3_5_text", directory, linear_num_key_heads=4)


@pytest.mark.slow
def test_a_hybrid_caches_its_states_generates_transformers_tokens_and_builds_engines(
    qwen3_5: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    checkpoint, reference = qwen3_5
    # fp16, the form checked here (its bf16 default builds too)
    config = CompileConfig.create(
        {"source": str(checkpoint), "targets": ["cpu", "sm_86", "sm_120"], "precision": "fp16"}
    )
    manifest = compile(config, tmp_path / "out").manifest
    generation = manifest.generation
    assert generation is not None and generation.kv_cache == "static"
    # layer 0 is Gated DeltaNet (4 key and value heads of 16 and 8): its conv over q, k, v, kernel 4
    assert generation.state_layers == [0] and generation.attention_layers == [1]
    assert generation.state_shapes == {"conv": [2 * 4 * 16 + 4 * 8, 3], "recurrent": [4, 16, 8]}
    names = {spec.name for spec in manifest.inputs}
    assert {"past_key_values.0.conv", "past_key_values.0.recurrent", "past_key_values.1.key"} <= names
    assert "past_key_values.0.key" not in names
    for target in manifest.targets[1:]:
        assert target.status == "built" and target.variant == "fp16", target.reason
    assert_greedy_tokens_match(reference, tmp_path / "out")

    # the fp16 variant's recurrence is fp32 from the state it reads to the state it writes
    graph = onnx.load(tmp_path / "out" / "variants" / "fp16.onnx", load_external_data=False).graph
    scan = next(node for node in graph.node if node.op_type == "Scan")
    assert scan.input[0] == "past_key_values.0.recurrent" and scan.output[0] == "present.0.recurrent"
    body = next(attribute.g for attribute in scan.attribute if attribute.name == "body")
    assert {value.type.tensor_type.elem_type for value in body.input} == {onnx.TensorProto.FLOAT}

    selection = select_engine(read_manifest(tmp_path / "out"), Device("sm_86", tensorrt={"tensorrt-rtx": _rtx()}),
                              tmp_path / "out")  # fmt: skip
    assert selection.target is None and "linear-attention states" in selection.reason

    # the continuous-batching engine carries the states too: a request read in chunks while the slots on both
    # sides decode keeps its state through their calls (its throwaway rows' states are not kept), and no prefix
    # of a state is reused for a later prompt (a recurrent state holds every token it read, not one per position)
    prompts = [np.arange(3, 9), np.arange(20, 24), np.arange(40, 46), np.arange(60, 100)]
    new_tokens = [24, 2, 24, 6]
    with load(tmp_path / "out", backend="onnxruntime") as model:
        expected = [
            model.generate(prompt, max_new_tokens=n, eos_token_id=[])[0, len(prompt) :].tolist()
            for prompt, n in zip(prompts, new_tokens, strict=True)
        ]
        with model.engine(slots=3, prefill_chunk=4) as engine:
            with engine._turn:  # admitted together, in this order, into slots 0, 1 and 2
                streams = [
                    engine.submit(prompt, max_new_tokens=n, ignore_eos=True)
                    for prompt, n in zip(prompts[:3], new_tokens[:3], strict=True)
                ]
            list(streams[1])  # slot 1 is free again while slots 0 and 2 decode: the long prompt is read there
            streams.append(engine.submit(prompts[3], max_new_tokens=new_tokens[3], ignore_eos=True))
            for stream in (streams[0], streams[2], streams[3]):
                list(stream)
            got = [stream.tokens for stream in streams]
            again = engine.submit(prompts[3], max_new_tokens=new_tokens[3], ignore_eos=True)
            assert list(again) == expected[3] and again.cached_tokens == 0
            slots = engine._slots  # a slot's states start at zero for its next request, whatever the last one left
            assert slots.states and all(slots.cache[name][1].any() for name in slots.states)
            slots.start(1)
            assert not any(slots.cache[name][1].any() for name in slots.states)
    assert got == expected


def _rtx() -> str:
    import tensorrt_rtx

    return str(tensorrt_rtx.__version__)
