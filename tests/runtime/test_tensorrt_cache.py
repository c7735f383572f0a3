"""runtime/tensorrt_cache.py: the device-resident static cache of the TensorRT backend.

Without a GPU: its pure parts, and the whole session over a fake CUDA runtime (host memory standing for the
device, every copy checked to stay inside its allocation, graph capture recorded and replayed) and a fake engine
that runs the static-cache graph on ONNX Runtime at the addresses the session bound: generation must give ONNX
Runtime's own tokens, copy what runtime/copy_plan.py says, and run the decode step as a graph. With a GPU
(`gpu`, scripts/gpu-check.sh): the same against a real engine.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorsmith.runtime.buffer_pool import BufferPool
from tensorsmith.runtime.copy_plan import LOGITS, MASK, step_copies
from tensorsmith.runtime.cuda_graphs import DecodeGraph
from tensorsmith.runtime.cuda_runtime import CopyCount, CopyMeter
from tensorsmith.runtime.generation import Generator
from tensorsmith.runtime.generation_request import Request
from tensorsmith.runtime.kv_cache import WRITE_INDICES, CacheSession, CacheShape, StepFeeds, present_of
from tensorsmith.runtime.manifest import GenerationRecord, read_manifest
from tensorsmith.runtime.sampling import Sampling
from tensorsmith.runtime.tensorrt_backend import uses_own_cuda_graphs
from tensorsmith.runtime.tensorrt_cache import CacheRuntime, TensorRTStaticCache, moved_rows, step_shapes
from tensorsmith.runtime.tensorrt_engine import (
    Bounds,
    EngineContexts,
    EngineIO,
    capacity_for,
    decode_profile,
    engine_io,
    fitting_profile,
)

LAYOUT = GenerationRecord(layers=2, kv_heads=2, head_dim=4, max_sequence_length=64)


def profiles_for(layout: GenerationRecord, capacity: int, batch: int = 8) -> list[dict[str, Bounds]]:
    """A static-cache engine's two profiles as compiler/engines/profiles.py makes them, the cache length fixed."""
    cache = (layout.kv_heads, capacity, layout.head_dim)

    def profile(sequence: tuple[int, int, int], opt_batch: int) -> dict[str, Bounds]:
        rows = (1, opt_batch, batch)
        shapes: dict[str, Bounds] = {
            name: tuple((b, s) for b, s in zip(rows, sequence, strict=True))  # type: ignore[misc]
            for name in ("input_ids", "position_ids")
        }
        shapes[MASK] = tuple((b, capacity) for b in rows)  # type: ignore[assignment]
        shapes[WRITE_INDICES] = tuple((b,) for b in rows)  # type: ignore[assignment]
        for layer in range(layout.layers):
            for kind in ("key", "value"):
                shapes[f"past_key_values.{layer}.{kind}"] = tuple((b, *cache) for b in rows)  # type: ignore[assignment]
        return shapes

    return [profile((2, min(16, capacity), capacity), 1), profile((1, 1, 1), batch)]


# --------------------------------------------------------------------------------------------------------------
# Pure parts


def test_each_step_fits_exactly_one_of_the_decoders_profiles() -> None:
    profiles = profiles_for(LAYOUT, 32)
    shape = CacheShape(LAYOUT, 4, 32, np.dtype("float16"))
    assert fitting_profile(profiles, step_shapes(shape, 7)) == 0
    assert fitting_profile(profiles, step_shapes(shape, 1)) == 1 == decode_profile(profiles)
    assert fitting_profile(profiles, step_shapes(CacheShape(LAYOUT, 9, 32, np.dtype("float16")), 1)) is None
    assert fitting_profile(profiles, step_shapes(CacheShape(LAYOUT, 4, 31, np.dtype("float16")), 1)) is None


def test_the_step_shapes_are_the_static_graphs() -> None:
    shapes = step_shapes(CacheShape(LAYOUT, 3, 20, np.dtype("float32")), 5)
    assert shapes["input_ids"] == shapes["position_ids"] == (3, 5)
    assert shapes[MASK] == (3, 20) and shapes[WRITE_INDICES] == (3,)
    assert shapes["past_key_values.1.value"] == (3, 2, 20, 4) and len(shapes) == 4 + 2 * LAYOUT.layers


def test_the_capacity_is_the_engines_where_it_is_static() -> None:
    assert capacity_for(None, 100) == 100
    assert capacity_for(512, 100) == 512
    with pytest.raises(ValueError, match="holds 512"):
        capacity_for(512, 513)


def test_the_session_shape_takes_the_engines_length_and_dtype() -> None:
    io = EngineIO(10, np.dtype("float16"), np.dtype("float16"), 64, tuple(profiles_for(LAYOUT, 64)))
    shape = io.session_shape(CacheShape(LAYOUT, 2, 20, np.dtype("float32")))
    assert (shape.rows, shape.capacity, shape.dtype) == (2, 64, np.dtype("float16"))
    assert io.graph_profile == 1
    assert EngineIO(10, np.dtype("float16"), np.dtype("float16"), None, io.profiles).graph_profile is None


def test_an_engine_that_aliases_a_present_elsewhere_is_refused() -> None:
    from tensorsmith.runtime.errors import RuntimeLoadError

    aliases = {"present.0.key": "past_key_values.0.value"}
    io = EngineIO(10, np.dtype("float16"), np.dtype("float16"), 64, (), aliases)
    with pytest.raises(RuntimeLoadError, match="aliases present.0.key"):
        io.check_aliases(["past_key_values.0.key"])


def test_engine_io_reads_a_static_cache_engine() -> None:
    shapes = {"input_ids": (-1, -1), "write_indices": (-1,), "past_key_values.0.key": (-1, 2, 48, 4),
              "logits": (-1, 1, 99), "present.0.key": (-1, 2, 48, 4)}  # fmt: skip

    class Engine:
        num_io_tensors = len(shapes)

        def get_tensor_name(self, index: int) -> str:
            return list(shapes)[index]

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return shapes[name]

        def get_tensor_dtype(self, name: str) -> str:
            return "float16" if "key" in name else "float32"

        def get_aliased_input_tensor(self, name: str) -> str:
            return name.replace("present.", "past_key_values.")

    class Trt:
        nptype = staticmethod(np.dtype)

    io = engine_io(Engine(), Trt(), [])
    assert io is not None and (io.vocabulary, io.capacity) == (99, 48)
    assert (io.cache_dtype, io.logits_dtype) == (np.dtype("float16"), np.dtype("float32"))
    assert io.aliases == {"present.0.key": "past_key_values.0.key"}


def test_a_reorder_moves_only_the_rows_that_change() -> None:
    assert moved_rows(np.array([0, 0, 2, 1])) == [(1, 0), (3, 1)]
    assert moved_rows(np.arange(4)) == []


def test_the_decode_graph_warms_up_captures_then_launches() -> None:
    cudart = FakeCudart()
    context = _CountingContext(cudart)
    graph = DecodeGraph()
    actions = []
    for _ in range(4):
        actions.append(graph.next_action())
        graph.run(context, cudart, 7)
    assert actions == ["execute", "capture", "launch", "launch"]
    assert (graph.captures, graph.launches, context.enqueued) == (1, 3, 2)  # the captured enqueue ran 3 times
    assert context.ran == 4
    graph.reset(cudart)
    assert graph.next_action() == "execute"


def test_a_context_that_cannot_be_captured_runs_without_a_graph() -> None:
    cudart = FakeCudart()
    context = _CountingContext(cudart, capturable=False)
    graph = DecodeGraph()
    for _ in range(3):
        graph.run(context, cudart, 7)
    assert graph.failed and graph.launches == 0 and context.ran == 3


def test_a_context_is_bound_again_only_when_someone_else_bound_it() -> None:
    made: list[int] = []
    contexts = EngineContexts(profiles_for(LAYOUT, 32), lambda index: made.append(index) or f"context {index}")
    shape = CacheShape(LAYOUT, 2, 32, np.dtype("float32"))
    first, second = object(), object()
    assert contexts.get(step_shapes(shape, 1), first) == (1, "context 1", True)
    assert contexts.get(step_shapes(shape, 1), first)[2] is False
    assert contexts.get(step_shapes(shape, 1), second)[2] is True
    assert contexts.get(step_shapes(shape, 1))[2] is True  # `run` binds every call
    assert contexts.get(step_shapes(shape, 5), second)[:2] == (0, "context 0") and made == [1, 0]
    assert contexts.get(step_shapes(shape, 6), second)[2] is True  # another prompt length
    with pytest.raises(ValueError, match="fit none of the engine's profiles"):
        contexts.get(step_shapes(CacheShape(LAYOUT, 9, 32, np.dtype("float32")), 1))


def test_the_meter_counts_what_is_handed_to_cuda() -> None:
    cudart = FakeCudart()
    meter = CopyMeter(cudart)
    device, host = cudart.cudaMalloc(64)[1], cudart.cudaMallocHost(64)[1]
    meter.cudaMemcpyAsync(device, host, 16, cudart.cudaMemcpyKind(1), 7)
    meter.cudaMemcpy2DAsync(device, 32, host, 8, 8, 2, cudart.cudaMemcpyKind(1), 7)
    meter.cudaMemcpyAsync(host, device, 24, cudart.cudaMemcpyKind(2), 7)
    assert meter.count == CopyCount(to_device=32, to_host=24, on_device=0, copies=3)
    assert meter.cudaStreamSynchronize(7) == (0,)  # everything else passes through


def test_rtx_captures_its_own_graphs() -> None:
    assert uses_own_cuda_graphs("tensorrt-rtx") and not uses_own_cuda_graphs("tensorrt")


# --------------------------------------------------------------------------------------------------------------
# Fakes: a CUDA runtime over host memory, an engine over ONNX Runtime


class FakeCudart:
    """cuda-python's runtime API over host memory. "Device" allocations start as 0xFF bytes (NaN as floats, so a
    cache that is not zeroed shows); every copy must lie inside allocations of the kinds it names; work enqueued
    while capturing is recorded and replayed by cudaGraphLaunch."""

    class cudaMemcpyKind(enum.IntEnum):
        cudaMemcpyHostToHost = 0
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3

    class cudaStreamCaptureMode(enum.IntEnum):
        cudaStreamCaptureModeGlobal = 0
        cudaStreamCaptureModeThreadLocal = 1

    def __init__(self) -> None:
        self.device: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}
        self.copied: Counter[str] = Counter()
        self.capturing: list[Callable[[], None]] | None = None
        self.synchronized = 0

    def _allocate(self, table: dict[int, np.ndarray], size: int) -> tuple[int, int]:
        memory = np.full(max(size, 1), 0xFF, np.uint8)
        table[memory.ctypes.data] = memory
        return 0, memory.ctypes.data

    def cudaMalloc(self, size: int) -> tuple[int, int]:
        return self._allocate(self.device, size)

    def cudaMallocHost(self, size: int) -> tuple[int, int]:
        return self._allocate(self.host, size)

    def cudaFree(self, pointer: int) -> tuple[int]:
        del self.device[pointer]
        return (0,)

    def cudaFreeHost(self, pointer: int) -> tuple[int]:
        del self.host[pointer]
        return (0,)

    def inside(self, pointer: int, nbytes: int, device: bool) -> bool:
        table = self.device if device else self.host
        return any(base <= pointer and pointer + nbytes <= base + memory.nbytes for base, memory in table.items())

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        assert self.capturing is None, "the session copies outside the captured graph"
        to_device, from_device = kind in (1, 3), kind in (2, 3)
        assert self.inside(dst, nbytes, to_device) and self.inside(src, nbytes, from_device), "a copy out of bounds"
        ctypes.memmove(dst, src, nbytes)

    def cudaMemcpyAsync(self, dst: int, src: int, count: int, kind: Any, stream: Any) -> tuple[int]:
        self._copy(dst, src, count, int(kind))
        self.copied[self.cudaMemcpyKind(int(kind)).name] += count
        return (0,)

    def cudaMemcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                          kind: Any, stream: Any) -> tuple[int]:  # fmt: skip
        for row in range(height):
            self._copy(dst + row * dpitch, src + row * spitch, width, int(kind))
        self.copied[self.cudaMemcpyKind(int(kind)).name] += width * height
        return (0,)

    def cudaMemsetAsync(self, pointer: int, value: int, count: int, stream: Any) -> tuple[int]:
        assert self.inside(pointer, count, True)
        ctypes.memset(pointer, value, count)
        return (0,)

    def cudaStreamSynchronize(self, stream: Any) -> tuple[int]:
        self.synchronized += 1
        return (0,)

    def cudaStreamBeginCapture(self, stream: Any, mode: Any) -> tuple[int]:
        self.capturing = []
        return (0,)

    def cudaStreamEndCapture(self, stream: Any) -> tuple[int, list[Callable[[], None]] | None]:
        graph, self.capturing = self.capturing, None
        return 0, graph

    def cudaGraphInstantiate(self, graph: list[Callable[[], None]], flags: int) -> tuple[int, list]:
        return 0, list(graph)

    def cudaGraphLaunch(self, graph: list[Callable[[], None]], stream: Any) -> tuple[int]:
        for work in graph:
            work()
        return (0,)

    def cudaGraphExecDestroy(self, graph: Any) -> tuple[int]:
        return (0,)

    def cudaGraphDestroy(self, graph: Any) -> tuple[int]:
        return (0,)


class _CountingContext:
    """A context whose enqueued work only counts its runs (captured while the fake CUDA runtime captures)."""

    def __init__(self, cudart: FakeCudart, capturable: bool = True) -> None:
        self.cudart, self.capturable, self.enqueued, self.ran = cudart, capturable, 0, 0

    def is_stream_capturable(self, stream: Any) -> bool:
        return self.capturable

    def execute_async_v3(self, stream: Any) -> bool:
        self.enqueued += 1

        def work() -> None:
            self.ran += 1

        if self.cudart.capturing is not None:
            self.cudart.capturing.append(work)
        else:
            work()
        return True


def _at(pointer: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(pointer)).view(dtype).reshape(shape)


class FakeContext:
    """An execution context that runs the static-cache graph on ONNX Runtime over the bound addresses, checking
    the shapes against its profile and each present's address against its past's (TensorRT's KV-cache update
    needs them the same)."""

    def __init__(self, session: Any, cudart: FakeCudart, profile: dict[str, Bounds]) -> None:
        self._session, self._cudart, self._profile = session, cudart, profile
        self._dtypes = {v.name: _ONNX_DTYPES[v.type] for v in [*session.get_inputs(), *session.get_outputs()]}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0

    def set_optimization_profile_async(self, index: int, stream: Any) -> bool:
        return True

    def set_input_shape(self, name: str, dims: tuple[int, ...]) -> bool:
        low, _, high = self._profile[name]
        assert all(lo <= d <= hi for d, lo, hi in zip(dims, low, high, strict=True)), f"{name} {dims} off profile"
        self.shapes[name] = tuple(dims)
        return True

    def set_tensor_address(self, name: str, pointer: int) -> bool:
        self.addresses[name] = pointer
        return True

    def execute_async_v3(self, stream: Any) -> bool:
        shapes, addresses = dict(self.shapes), dict(self.addresses)  # baked in, as a captured graph's are

        def work() -> None:
            self._run(shapes, addresses)

        if self._cudart.capturing is not None:
            self._cudart.capturing.append(work)
        else:
            work()
        return True

    def _run(self, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int]) -> None:
        self.runs += 1
        feeds = {}
        for name, shape in shapes.items():
            dtype = self._dtypes[name]
            assert self._cudart.inside(addresses[name], int(np.prod(shape)) * dtype.itemsize, True)
            feeds[name] = _at(addresses[name], shape, dtype).copy()
        names = [output.name for output in self._session.get_outputs()]
        for name, value in zip(names, self._session.run(names, feeds), strict=True):
            if name.startswith("present."):
                assert addresses[name] == addresses[name.replace("present.", "past_key_values.", 1)], name
            assert self._cudart.inside(addresses[name], value.nbytes, True)
            _at(addresses[name], value.shape, value.dtype)[...] = value


_ONNX_DTYPES = {"tensor(int64)": np.dtype("int64"), "tensor(float)": np.dtype("float32"),
                "tensor(float16)": np.dtype("float16")}  # fmt: skip


class FakeGpu:
    """A CacheRuntime over the fakes, for the static-cache graph of a cpu artifact; `capacity`: the engine's
    static cache length."""

    def __init__(self, artifact: Path, explicit_graphs: bool, capacity: int = 48) -> None:
        import onnxruntime

        manifest = read_manifest(artifact)
        assert manifest.generation is not None and manifest.generation.kv_cache == "static"
        self.layout = manifest.generation
        cpu = next(target for target in manifest.targets if target.name == "cpu")
        session = onnxruntime.InferenceSession(str(artifact / manifest.variant(cpu.variant).path),
                                               providers=["CPUExecutionProvider"])  # fmt: skip
        self.cudart = FakeCudart()
        meter = CopyMeter(self.cudart)
        profiles = profiles_for(self.layout, capacity)
        self.made: list[FakeContext] = []

        def create(index: int) -> FakeContext:
            self.made.append(FakeContext(session, self.cudart, profiles[index]))
            return self.made[-1]

        logits = next(output for output in session.get_outputs() if output.name == LOGITS)
        pasts = CacheShape(self.layout, 1, capacity, np.dtype("float32")).pasts
        io = EngineIO(int(logits.shape[-1]), np.dtype("float32"), np.dtype("float32"), capacity, tuple(profiles),
                      {present_of(past): past for past in pasts})  # fmt: skip
        contexts = EngineContexts(profiles, create)
        self.runtime = CacheRuntime(io, contexts, meter, 7, threading.Lock(), BufferPool(meter, contexts.forget),
                                    explicit_graphs)  # fmt: skip
        self.sessions: list[TensorRTStaticCache] = []

    def open_cache(self, rows: int, capacity: int) -> CacheSession:
        session = TensorRTStaticCache(self.runtime, CacheShape(self.layout, rows, capacity, np.dtype("float32")))
        self.sessions.append(session)
        return session

    def generate(self, prompt: np.ndarray, mask: np.ndarray, new_tokens: int, beams: int = 1) -> np.ndarray:
        request = Request(self.layout, prompt, mask, new_tokens, Sampling(), beams, [], 0, None)
        return Generator(self.open_cache).generate(request)


def _prompts() -> tuple[np.ndarray, np.ndarray]:
    """Two prompts of 9 and 6 tokens, the shorter left padded."""
    prompt = np.array([[5, 17, 99, 230, 41, 7, 300, 12, 64], [0, 0, 0, 88, 150, 3, 9, 512, 31]], np.int64)
    return prompt, (prompt != 0).astype(np.int64)


def _reference(artifact: Path, prompt: np.ndarray, mask: np.ndarray, new_tokens: int, beams: int = 1) -> np.ndarray:
    from tensorsmith.runtime import load

    with load(artifact, backend="onnxruntime") as model:
        return model.generate(prompt, mask, max_new_tokens=new_tokens, num_beams=beams, eos_token_id=[],
                              pad_token_id=0)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("explicit_graphs", [True, False], ids=["tensorrt", "tensorrt-rtx"])
def test_generation_on_the_fake_device_gives_onnxruntimes_tokens(tinylm_cpu_artifact: Path,
                                                                  explicit_graphs: bool) -> None:  # fmt: skip
    prompt, mask = _prompts()
    gpu = FakeGpu(tinylm_cpu_artifact, explicit_graphs)
    actual = gpu.generate(prompt, mask, 12)
    np.testing.assert_array_equal(actual, _reference(tinylm_cpu_artifact, prompt, mask, 12))
    session = gpu.sessions[-1]
    assert session.shape.capacity == 48  # the engine's static length, not the request's 21
    # what each step handed to CUDA is the plan: the prompt's step, then one-token steps
    assert session.copies[0].agrees_with(session.plan(9))
    assert all(count.agrees_with(session.plan(1)) for count in session.copies[1:]) and len(session.copies) == 12
    decode = step_copies(session.shape, 1, 2048, "float32")
    assert gpu.cudart.copied["cudaMemcpyHostToDevice"] == session.plan(9).bytes_to_device + 11 * decode.bytes_to_device
    assert gpu.cudart.copied["cudaMemcpyDeviceToHost"] == 12 * 2 * 2048 * 4  # the last position's logits only
    assert gpu.cudart.synchronized == 12  # one a step
    prefill_context, decode_context = gpu.made
    assert prefill_context.runs == 1 and decode_context.runs == 11
    if explicit_graphs:
        assert (session.graph.captures, session.graph.launches) == (1, 10)  # warm-up, capture, then launches
    else:
        assert session.graph.launches == 0  # TensorRT for RTX's own graphs


def test_a_second_request_reuses_the_buffers_and_the_graph(tinylm_cpu_artifact: Path) -> None:
    prompt, mask = _prompts()
    gpu = FakeGpu(tinylm_cpu_artifact, explicit_graphs=True)
    first = gpu.generate(prompt, mask, 6)
    allocations = dict(gpu.cudart.device)
    second = gpu.generate(prompt[:, 2:], mask[:, 2:], 6)  # another prompt length: the same buffers
    np.testing.assert_array_equal(first, _reference(tinylm_cpu_artifact, prompt, mask, 6))
    np.testing.assert_array_equal(second, _reference(tinylm_cpu_artifact, prompt[:, 2:], mask[:, 2:], 6))
    assert gpu.cudart.device.keys() == allocations.keys()  # nothing allocated for the second request
    graph = gpu.runtime.pool.idle.graph if gpu.runtime.pool.idle else None
    assert graph is not None and graph.captures == 1 and graph.launches == 4 + 5
    # a batch of another size: new buffers, the old ones freed, a graph of its own
    gpu.generate(prompt[:1], mask[:1], 6)
    assert len(gpu.cudart.device) == len(allocations)
    gpu.runtime.pool.close()
    assert not gpu.cudart.device and not gpu.cudart.host


def test_beam_search_reorders_the_cache_on_the_device(tinylm_cpu_artifact: Path) -> None:
    prompt, mask = _prompts()
    gpu = FakeGpu(tinylm_cpu_artifact, explicit_graphs=True)
    actual = gpu.generate(prompt, mask, 8, beams=3)
    np.testing.assert_array_equal(actual, _reference(tinylm_cpu_artifact, prompt, mask, 8, beams=3))
    moved = gpu.sessions[-1].reorder_copies
    assert moved.to_device == moved.to_host == 0  # rows gathered on the device, no host round trip


def test_a_call_to_run_in_between_rebinds_the_decode_context(tinylm_cpu_artifact: Path) -> None:
    gpu = FakeGpu(tinylm_cpu_artifact, explicit_graphs=True)
    prompt, mask = _prompts()
    with gpu.open_cache(2, 20) as cache:
        assert isinstance(cache, TensorRTStaticCache)
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        cache.step(StepFeeds(prompt, positions, 0, mask))
        ones = np.ones((2, 1), np.int64)
        for step in range(3):
            cache.step(StepFeeds(ones * 5, positions[:, -1:] + 1 + step, 9 + step, ones))
        assert cache.graph.captures == 1
        gpu.runtime.contexts.get(step_shapes(cache.shape, 1))  # what the backend's `run` does
        cache.step(StepFeeds(ones * 5, positions[:, -1:] + 4, 12, ones))
        assert cache.graph.next_action() == "capture"  # warmed up again on the bound context, captured next


def test_a_step_past_the_capacity_is_refused_before_anything_is_copied() -> None:
    io = EngineIO(10, np.dtype("float32"), np.dtype("float32"), 8, tuple(profiles_for(LAYOUT, 8)))
    cudart = FakeCudart()
    meter = CopyMeter(cudart)
    contexts = EngineContexts(io.profiles, lambda index: None)
    runtime = CacheRuntime(io, contexts, meter, 7, threading.Lock(), BufferPool(meter, contexts.forget), True)
    with TensorRTStaticCache(runtime, CacheShape(LAYOUT, 1, 8, np.dtype("float32"))) as cache:
        ones = np.ones((1, 1), np.int64)
        with pytest.raises(ValueError, match="past the cache's 8"):
            cache.step(StepFeeds(ones, ones, 8, ones))
    assert meter.count.copies == 0 and cudart.device  # nothing copied; the buffers kept for the next request
    runtime.pool.close()
    assert not cudart.device and not cudart.host
    cache = TensorRTStaticCache(runtime, CacheShape(LAYOUT, 1, 8, np.dtype("float32")))
    cache.close()  # a request that ends after its backend closed: freed, not kept
    assert not cudart.device and not cudart.host


# --------------------------------------------------------------------------------------------------------------
# bench/gpu_decode.py's pure parts (its table runs in scripts/gpu-check.sh)


def test_the_bandwidth_bound_by_hand() -> None:
    from bench.gpu_decode import bound_tokens_per_second, cache_bytes_read, peak_bandwidth

    # deviceQuery on an H100 PCIe: memory clock 1,593 MHz, a 5,120-bit bus: its 2.0 TB/s
    assert peak_bandwidth(1_593_000, 5120) == pytest.approx(2.039e12, rel=1e-3)
    # issue 25: 2.5 GB of fp16 weights read at 4.8 TB/s: ~0.5 ms a step
    assert 1 / bound_tokens_per_second(1, 2_500_000_000, 0, 4.8e12) == pytest.approx(0.52e-3, rel=0.01)
    # the cache read at its whole length: Llama-3.2-1B's at 2,048 fp32 slots is the 134 MB
    read = cache_bytes_read(16, 1, 8, 2048, 64, 4)
    assert read == 134_217_728
    assert bound_tokens_per_second(8, 2_500_000_000, 8 * read, 4.8e12) == pytest.approx(8 * 4.8e12 / 3.57e9, rel=0.01)


def test_the_gpu_table_renders_measured_and_skipped_rows() -> None:
    from bench.gpu_decode import DecodeRow, table

    rows = [DecodeRow("tinylm", 1, 128, 1280, 1234.5, 32, 8192, True, 5000.0),
            DecodeRow("tinylm", 8, 1024, 512, None, note="n/a: 1092 slots > 512")]  # fmt: skip
    lines = table(rows).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[2].count("|") == lines[3].count("|")
    assert "| 1,234 | 32 | 8,192 | yes | 5,000 | 25% |" in lines[2] and "n/a: 1092 slots" in lines[3]
    assert rows[0].share_of_bound == pytest.approx(0.2469) and rows[1].share_of_bound is None


def test_the_gpu_tables_decode_loop_runs_on_the_host(tinylm_cpu_artifact: Path) -> None:
    """bench/gpu_decode.py's loop, on ONNX Runtime here: a row per batch and context, too long a context noted."""
    from bench.gpu_decode import decode_rows

    rows = decode_rows(tinylm_cpu_artifact, [2], [16, 1024], 3, None, backend_name="onnxruntime")
    assert [row.context for row in rows] == [16, 1024]
    assert rows[0].tokens_per_second and rows[0].tokens_per_second > 0 and "not on the device" in rows[0].note
    assert rows[1].tokens_per_second is None and rows[1].note.startswith("n/a")


# --------------------------------------------------------------------------------------------------------------
# On a GPU (scripts/gpu-check.sh)


@pytest.fixture(scope="module")
def tinylm_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """samples/tinylm compiled for the cpu and this GPU (its engine built here), or skipped without a GPU."""
    from tensorsmith.runtime import detect_device

    device = detect_device()
    if device.compute_capability is None:
        pytest.skip(device.reason)
    from tests.conftest import SAMPLES, run_cli_json

    out = tmp_path_factory.mktemp("tinylm-gpu") / "out"
    run_cli_json("compile", SAMPLES / "tinylm" / "tensorsmith.toml", "-o", out, "--target", "cpu",
                 "--target", device.compute_capability)  # fmt: skip
    return out


@pytest.mark.gpu
def test_greedy_tokens_on_the_device_cache_equal_onnxruntimes(tinylm_engine: Path) -> None:
    from tensorsmith.runtime import load

    prompt, mask = _prompts()
    with load(tinylm_engine, backend="tensorrt") as model:
        actual = model.generate(prompt, mask, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(actual, _reference(tinylm_engine, prompt, mask, 16))


@pytest.mark.gpu
def test_beam_search_on_the_device_cache_equals_onnxruntimes(tinylm_engine: Path) -> None:
    from tensorsmith.runtime import load

    prompt, mask = _prompts()
    with load(tinylm_engine, backend="tensorrt") as model:
        actual = model.generate(prompt, mask, max_new_tokens=8, num_beams=2, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(actual, _reference(tinylm_engine, prompt, mask, 8, beams=2))


@pytest.mark.gpu
def test_a_device_step_copies_the_plan_whatever_the_context(tinylm_engine: Path) -> None:
    """Bytes handed to cudaMemcpy*Async per step (CopyMeter, at the CUDA API): the plan's, the same for a
    context of 16 and of 256 tokens."""
    from tensorsmith.runtime import load

    decode_counts = []
    with load(tinylm_engine, backend="tensorrt") as model:
        backend: Any = model._backend
        layout = read_manifest(tinylm_engine).generation
        assert layout is not None
        for context in (16, 256):
            cache = backend.open_cache(CacheShape(layout, 2, context + 8, np.dtype("float16")), static=True)
            assert isinstance(cache, TensorRTStaticCache)
            with cache:
                prompt = np.full((2, context), 7, np.int64)
                positions = np.tile(np.arange(context), (2, 1))
                cache.step(StepFeeds(prompt, positions, 0, np.ones_like(prompt)))
                ones = np.ones((2, 1), np.int64)
                for step in range(4):
                    cache.step(StepFeeds(ones * 9, ones * (context + step), context + step, ones))
                assert cache.copies[0].agrees_with(cache.plan(context))
                assert all(count.agrees_with(cache.plan(1)) for count in cache.copies[1:])
                decode_counts.append(cache.copies[-1])
                if not uses_own_cuda_graphs(backend._flavour):
                    assert cache.graph.launches >= 2
    assert decode_counts[0] == decode_counts[1]
