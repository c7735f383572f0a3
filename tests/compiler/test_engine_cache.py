"""The engine cache: a second compile of the same graph for the same targets reuses the engines (hits, recorded
in the manifest); another graph, another target or a damaged entry builds for real."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli_json, small_mlp_onnx

TARGETS = ["--target", "sm_86", "--target", "sm_89"]


def compile_with_cache(source: Path, out: Path, cache: Path, *extra: str) -> dict:
    return run_cli_json("compile", source, "--input", "x:float32:batch,8", "-o", out, "--engine-cache", cache, *extra)


def caches(compiled: dict) -> dict[str, str]:
    return {t["name"]: t["engine"]["cache"] for t in compiled["targets"] if t["engine"]}


def test_a_second_compile_reuses_the_engines(tmp_path: Path) -> None:
    source = small_mlp_onnx(tmp_path / "mlp.onnx", opset=17)
    first = compile_with_cache(source, tmp_path / "a", tmp_path / "cache", *TARGETS)
    assert caches(first) == {"sm_86": "miss", "sm_89": "miss"}
    second = compile_with_cache(source, tmp_path / "b", tmp_path / "cache", *TARGETS)
    assert caches(second) == {"sm_86": "hit", "sm_89": "hit"}
    for target in ("sm_86", "sm_89"):
        built = (tmp_path / "a" / "engines" / f"{target}.engine").read_bytes()
        assert (tmp_path / "b" / "engines" / f"{target}.engine").read_bytes() == built
        record = json.loads((tmp_path / "b" / "engines" / f"{target}.json").read_text())
        assert record["engine_cache"] == "hit"
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert {row["target"]: row["cache"] for row in report["engines"]} == {"sm_86": "hit", "sm_89": "hit"}


def test_another_graph_or_setting_misses(tmp_path: Path) -> None:
    source = small_mlp_onnx(tmp_path / "mlp.onnx", opset=17)
    compile_with_cache(source, tmp_path / "a", tmp_path / "cache", "--target", "sm_86")
    unfused = compile_with_cache(source, tmp_path / "b", tmp_path / "cache", "--target", "sm_86", "--no-fuse")
    assert caches(unfused) == {"sm_86": "miss"}  # another graph (GELU left unfused): other bytes
    assert caches(compile_with_cache(source, tmp_path / "c", tmp_path / "cache", "--target", "sm_89")) == {
        "sm_89": "miss"
    }


@pytest.mark.parametrize("damage", ["engine", "checksum"])
def test_a_damaged_entry_is_rebuilt_not_served(tmp_path: Path, damage: str) -> None:
    source = small_mlp_onnx(tmp_path / "mlp.onnx", opset=17)
    compile_with_cache(source, tmp_path / "a", tmp_path / "cache", "--target", "sm_86")
    (entry,) = (tmp_path / "cache").rglob("*.engine")
    victim = entry if damage == "engine" else entry.with_suffix(".sha256")
    victim.write_bytes(victim.read_bytes()[:-8])
    again = compile_with_cache(source, tmp_path / "b", tmp_path / "cache", "--target", "sm_86")
    assert caches(again) == {"sm_86": "miss"}


def test_a_plan_built_to_its_destination_stays_out_of_memory(tmp_path: Path) -> None:
    """The compile's builds write the plan straight into the artifact (a 1B decoder's is 3 GB): the record holds no
    bytes, the file is whole where it was asked for, no scratch is left beside it, and the cache keeps a copy."""
    from tensorsmith.compiler.engines.builder import build_engine
    from tensorsmith.compiler.engines.profiles import Profile
    from tensorsmith.compiler.settings import BuildConfig

    source = small_mlp_onnx(tmp_path / "mlp.onnx", opset=17, batch=2)
    profile = Profile({"x": ((2, 8), (2, 8), (2, 8))})
    destination = tmp_path / "engines" / "sm_86.engine"
    destination.parent.mkdir()
    options = BuildConfig(engine_cache_dir=tmp_path / "cache")
    built = build_engine(source, "sm_86", profile, options=options, destination=destination)
    assert built.plan == b"" and built.plan_path == destination and built.cache == "miss"
    assert built.size == destination.stat().st_size > 1000
    assert [path.name for path in destination.parent.iterdir()] == ["sm_86.engine"]
    (cached,) = (tmp_path / "cache").rglob("*.engine")
    assert cached.read_bytes() == destination.read_bytes()
    again = build_engine(source, "sm_86", profile, options=options, destination=tmp_path / "again.engine")
    assert again.cache == "hit" and (tmp_path / "again.engine").read_bytes() == destination.read_bytes()
    in_memory = build_engine(source, "sm_86", profile, options=options)
    assert in_memory.plan == destination.read_bytes() and in_memory.plan_path is None
