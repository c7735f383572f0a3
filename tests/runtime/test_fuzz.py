"""Fuzzing: hypothesis over config parsing, manifest parsing and input validation; a mutation fuzzer over ONNX
protobufs through load() + run(). Nothing may escape but a TensorsmithError (or, for feeds, a ValueError)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import compile_fuzz_artifact, fuzz
from tensorsmith.compiler import CompileConfig
from tensorsmith.core.errors import ConfigError
from tensorsmith.runtime import ArtifactError, TensorSpec
from tensorsmith.runtime.manifest import Manifest, read_manifest
from tensorsmith.runtime.specs import check_feeds

LOADER_CASES = 300

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
CONFIG_KEYS = [*CompileConfig.model_fields, "colour", ""]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), json_values, max_size=6))
def test_config_parsing_accepts_or_names_the_problem(fields: dict[str, Any]) -> None:
    try:
        CompileConfig.create(fields)
    except ConfigError as err:
        assert err.message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_toml_text_parses_or_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "tensorsmith.toml"
    path.write_text(text)
    try:
        CompileConfig.from_toml(path)
    except ConfigError as err:
        assert str(path) in err.message or "tensorsmith.toml" in err.message


@pytest.fixture(scope="module")
def fuzz_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return compile_fuzz_artifact(tmp_path_factory.mktemp("fuzz"))


def _replace_somewhere(document: Any, value: Any, path: list[int]) -> Any:
    """`document` with one node (chosen by `path`, a list of indices) replaced by `value`."""
    if not path or not isinstance(document, (dict, list)) or not document:
        return value
    if isinstance(document, dict):
        key = list(document)[path[0] % len(document)]
        return {**document, key: _replace_somewhere(document[key], value, path[1:])}
    index = path[0] % len(document)
    return [*document[:index], _replace_somewhere(document[index], value, path[1:]), *document[index + 1 :]]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(json_values, st.lists(st.integers(0, 50), max_size=5))
def test_manifest_parsing_accepts_or_raises_an_artifact_error(
    fuzz_artifact: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, value: Any, path: list[int]
) -> None:
    artifact, _ = fuzz_artifact
    original = json.loads((artifact / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(_replace_somewhere(original, value, path)))
    try:
        assert isinstance(read_manifest(tmp_path), Manifest)
    except ArtifactError as err:
        assert "manifest.json" in err.message


dtypes = st.sampled_from(["float32", "float64", "int64", "int32", "float16", "bool", "uint8"])
SPECS = [TensorSpec("ids", "int64", ("batch", "sequence")), TensorSpec("pixels", "float32", ("batch", 3, 4))]
LIMITS = {"batch": {"min": 1, "max": 8}, "sequence": {"min": 1, "max": 16}}


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["ids", "pixels", "other"]),
        st.tuples(dtypes, st.lists(st.integers(0, 10), max_size=4)),
        max_size=3,
    )
)
def test_input_validation_passes_or_names_the_input(feeds: dict[str, tuple[str, list[int]]]) -> None:
    arrays = {name: np.zeros(shape, dtype) for name, (dtype, shape) in feeds.items()}
    try:
        checked = check_feeds(arrays, SPECS, LIMITS)
    except ValueError as err:
        assert any(f"'{name}'" in str(err) or name in str(err) for name in [*arrays, "ids", "pixels"])
        return
    assert checked.keys() == {"ids", "pixels"}
    assert checked["ids"].dtype == np.int64 and checked["ids"].shape[0] == checked["pixels"].shape[0] <= 8


def test_mutated_onnx_models_load_and_run_or_fail_with_a_tensorsmith_error(
    fuzz_artifact: tuple[Path, dict[str, np.ndarray]],
) -> None:
    artifact, feeds = fuzz_artifact
    outcomes, unexpected = fuzz(artifact, range(LOADER_CASES), feeds)
    assert not unexpected, unexpected[:5]
    assert sum(outcomes.values()) == LOADER_CASES
    assert outcomes["ran"] > 0 and outcomes["RuntimeLoadError"] > LOADER_CASES // 2  # the cases reach both ends
