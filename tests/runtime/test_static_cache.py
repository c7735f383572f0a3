"""The static KV cache at run time (runtime/kv_cache.py, runtime/onnxruntime_cache.py): ONNX Runtime writes each
step into the bound cache in place (it logs "in-place optimization not activated" when it has to copy, as the
unbound host session makes it), the buffers keep their addresses for the whole request, and both give the same
tokens as the dynamic cache."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.core.sessions import QUIET_SEVERITY
from tensorsmith.runtime import load
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.kv_cache import CacheShape, StaticCacheSession, StepFeeds
from tensorsmith.runtime.onnxruntime_backend import WARNING_SEVERITY
from tensorsmith.runtime.onnxruntime_cache import OnnxRuntimeStaticCache

COPY_WARNING = "in-place optimization not activated"
PROMPT = np.array([[1, 5, 9, 13, 17, 21]], np.int64)


@pytest.fixture
def onnxruntime_warnings() -> Iterator[None]:
    """ONNX Runtime's warnings through to stderr: its sessions log at WARNING when this logger is at DEBUG, and
    its kernels through the process-wide default logger, which a compile earlier in the process quietened."""
    import onnxruntime

    backend_logger = logging.getLogger("tensorsmith.runtime.onnxruntime_backend")
    level = backend_logger.level
    backend_logger.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears isEnabledFor's cache
    onnxruntime.set_default_logger_severity(WARNING_SEVERITY)
    yield
    onnxruntime.set_default_logger_severity(QUIET_SEVERITY)
    backend_logger.setLevel(level)


def test_onnxruntime_writes_the_cache_in_place(
    tinylm_cpu_artifact: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    onnxruntime_warnings: None,
) -> None:  # fmt: skip
    with load(tinylm_cpu_artifact, backend="onnxruntime") as model:
        assert model.manifest.generation is not None and model.manifest.generation.kv_cache == "static"
        bound = model.generate(PROMPT, max_new_tokens=8, eos_token_id=[])
        assert COPY_WARNING not in capfd.readouterr().err
        # the control: the same graph through plain `run` (every backend's host session) copies, and says so
        monkeypatch.setattr(type(model._backend), "open_cache", Backend.open_cache)
        copied = model.generate(PROMPT, max_new_tokens=8, eos_token_id=[])
        assert COPY_WARNING in capfd.readouterr().err
    np.testing.assert_array_equal(bound, copied)


def test_the_bound_buffers_keep_their_addresses_and_fill_slot_by_slot(tinylm_cpu_artifact: Path) -> None:
    with load(tinylm_cpu_artifact, backend="onnxruntime") as model:
        layout = model.manifest.generation
        assert layout is not None
        shape = CacheShape(layout, rows=1, capacity=10, dtype=np.dtype(np.float32))
        cache = model._backend.open_cache(shape, static=True)
        assert isinstance(cache, OnnxRuntimeStaticCache)
        key = cache.cache["past_key_values.0.key"]
        address = key.ctypes.data
        with cache:
            cache.step(StepFeeds(PROMPT, np.arange(6)[None], 0, np.ones_like(PROMPT)))
            filled = np.abs(key).sum(axis=(0, 1, 3)) > 0
            assert filled.tolist() == [True] * 6 + [False] * 4
            cache.step(StepFeeds(np.array([[3]]), np.array([[6]]), 6, np.ones((1, 1), np.int64)))
            assert (np.abs(key).sum(axis=(0, 1, 3)) > 0).tolist() == [True] * 7 + [False] * 3
            assert cache.cache["past_key_values.0.key"].ctypes.data == address and cache.mask[0].sum() == 7
            with pytest.raises(ValueError, match="past the cache's 10"):
                cache.step(StepFeeds(np.ones((1, 4), np.int64), np.arange(7, 11)[None], 7, np.ones((1, 4), np.int64)))


def test_the_static_cache_gives_the_dynamic_caches_tokens(
    tinylm_cpu_artifact: Path, tinylm_dynamic_cache_artifact: Path
) -> None:
    prompts = np.random.default_rng(0).integers(3, 200, (3, 10)).astype(np.int64)
    mask = np.ones_like(prompts)
    mask[1, :3] = mask[2, :6] = 0  # left padded
    with load(tinylm_cpu_artifact) as static, load(tinylm_dynamic_cache_artifact) as dynamic:
        assert dynamic.manifest.generation is not None and dynamic.manifest.generation.kv_cache == "dynamic"
        for rows, beams in ((3, 1), (2, 3)):  # at most 8 rows: the artifact's batch
            np.testing.assert_array_equal(
                static.generate(prompts[:rows], mask[:rows], max_new_tokens=12, num_beams=beams, eos_token_id=[]),
                dynamic.generate(prompts[:rows], mask[:rows], max_new_tokens=12, num_beams=beams, eos_token_id=[]),
            )


def test_a_host_session_reorders_rows_in_place(tinylm_cpu_artifact: Path) -> None:
    """Beam search's reorder keeps every buffer where it was (bound sessions rely on it)."""
    with load(tinylm_cpu_artifact, backend="onnxruntime") as model:
        layout = model.manifest.generation
        assert layout is not None
        session = StaticCacheSession(model._backend.run, CacheShape(layout, 3, 4, np.dtype(np.float32)))
        key = session.cache["past_key_values.0.key"]
        key[:] = np.arange(3)[:, None, None, None]
        address = key.ctypes.data
        session.reorder(np.array([2, 2, 0]))
        assert key.ctypes.data == address and key[:, 0, 0, 0].tolist() == [2, 2, 0]
