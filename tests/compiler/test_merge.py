"""`tensorsmith merge OUT PART...`: the engines CI matrix jobs built in copies of one artifact, merged into it.

One compile, as samples/ci/engines-matrix.yml's compile job makes it (no engine builder: the GPU targets are
recorded pending); the parts are copies of it in which the real CLI built real TensorRT-for-RTX engines."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.runtime.manifest import read_manifest, verified_file
from tests.conftest import compile_small_mlp, run_cli, run_cli_json

PENDING = ["sm_86", "sm_120"]  # the compile's GPU targets, recorded pending


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small MLP for cpu, sm_86 and sm_120, compiled where no engine builder is installed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tensorsmith.compiler.engines.records.module_installed", lambda name: False)
        artifact = compile_small_mlp(tmp_path_factory.mktemp("compile"), targets=["cpu", *PENDING])
    assert {t.name: t.status for t in read_manifest(artifact).targets} == {
        "cpu": "not-needed", "sm_86": "pending", "sm_120": "pending"}  # fmt: skip
    return artifact


def copy_of(artifact: Path, directory: Path) -> Path:
    shutil.copytree(artifact, directory)
    return directory


def build(part: Path, *targets: str) -> Path:
    for target in targets:
        assert run_cli_json("build", part, "--target", target)["status"] == "built"
    return part


@pytest.fixture(scope="module")
def parts(compiled: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two matrix jobs' parts: one built sm_86 and sm_89 (a target the compile did not have), the other sm_120
    and kept only what the recipe uploads (manifest.json and engines/)."""
    root = tmp_path_factory.mktemp("parts")
    first = build(copy_of(compiled, root / "part-a"), "sm_86", "sm_89")
    second = build(copy_of(compiled, root / "part-b"), "sm_120")
    for entry in second.iterdir():
        if entry.name not in ("manifest.json", "engines"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return first, second


@pytest.fixture
def out(compiled: Path, tmp_path: Path) -> Path:
    return copy_of(compiled, tmp_path / "model")


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` (hidden ones too) and its bytes' sha256."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}  # fmt: skip


def refused(out: Path, *parts: Path) -> str:
    """The one-line error of a merge that must not touch OUT (nor leave a lock beside it)."""
    before, siblings = snapshot(out), set(out.parent.glob(f".{out.name}.*"))
    result = run_cli("merge", out, *parts)
    assert result.exit_code == 1, result.stdout
    assert snapshot(out) == before and set(out.parent.glob(f".{out.name}.*")) == siblings
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "(hint: " in line
    return line


def test_merge_takes_each_parts_engines_into_one_artifact_that_loads(out: Path, parts: tuple[Path, Path]) -> None:
    first, second = parts
    merged = run_cli_json("merge", out, first, second)
    assert [(m["target"], m["part"]) for m in merged["added"]] == [
        ("sm_86", str(first)), ("sm_89", str(first)), ("sm_120", str(second))]  # fmt: skip
    assert merged["unchanged"] == [] and merged["pending"] == []
    manifest = read_manifest(out)
    assert [(t.name, t.status) for t in manifest.targets] == [
        ("cpu", "not-needed"), ("sm_86", "built"), ("sm_120", "built"), ("sm_89", "built")]  # fmt: skip
    for target in manifest.targets[1:]:
        assert target.engine is not None and target.builder == "tensorrt-rtx"
        engine = verified_file(out, target.engine.path, target.engine.sha256)
        assert engine == (out / "engines" / f"{target.name}.engine").resolve()
        details = json.loads((out / "engines" / f"{target.name}.json").read_text())
        assert details["sha256"] == target.engine.sha256 and details["compute_capability"] == target.name
    assert not [path for path in (out / "engines").iterdir() if path.name.startswith(".")]  # no temporary file
    assert "sm_120" in (out / "report.json").read_text()  # the report's engine table is refreshed

    from tensorsmith.runtime import load

    with load(out, backend="onnxruntime") as model:
        outputs = model.run({"x": np.ones((3, 8), np.float32)})
    assert outputs["y"].shape == (3, 4)


def test_an_engine_out_already_has_is_left_as_it_is(out: Path, parts: tuple[Path, Path], tmp_path: Path) -> None:
    """A part copied after some engines were in (as the compile's own engines are, in every part) carries them
    with the same sha256: only its new target is taken. A target two parts built alike is taken once."""
    first, _ = parts
    run_cli_json("merge", out, first)
    later = build(copy_of(out, tmp_path / "later"), "sm_120")
    twin = copy_of(later, tmp_path / "twin")
    merged = run_cli_json("merge", out, later, twin)
    assert [(m["target"], m["part"]) for m in merged["added"]] == [("sm_120", str(later))]
    assert merged["unchanged"] == ["sm_86", "sm_89"]
    assert {t.name for t in read_manifest(out).targets if t.status == "built"} == {"sm_86", "sm_89", "sm_120"}
    # merged before: every engine it has is in OUT already, so it adds no target
    line = refused(out, later)
    assert f"part {later} adds no target: OUT already has its engines (sm_86, sm_89, sm_120)" in line


def test_a_part_from_another_compile_is_refused(out: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    other = build(compile_small_mlp(tmp_path / "elsewhere", name="other"), "sm_86")
    line = refused(out, other)
    assert f"part {other} is from another compile: its source.path is {tmp_path / 'elsewhere' / 'mlp.onnx'}" in line
    assert "each matrix job downloads what the compile job uploaded" in line


def test_a_part_whose_variant_bytes_differ_is_refused(out: Path, parts: tuple[Path, Path], tmp_path: Path) -> None:
    """The same source recompiled into other bytes (new weights under the same path): its engines are not OUT's."""
    part = copy_of(parts[0], tmp_path / "recompiled")
    manifest = json.loads((part / "manifest.json").read_text())
    manifest["variants"][0]["sha256"] = "0" * 64
    (part / "manifest.json").write_text(json.dumps(manifest))
    line = refused(out, part)
    assert f"part {part} is from another compile: its variants.fp32.sha256 is 000000000000…, OUT's is " in line


def test_two_engines_for_one_target_are_refused(out: Path, parts: tuple[Path, Path], tmp_path: Path) -> None:
    """Another job built sm_86 with other builder settings: a different engine, whichever part comes first."""
    from tensorsmith.compiler.add_engine import build_target
    from tensorsmith.compiler.config import BuildConfig

    first, _ = parts
    other = copy_of(out, tmp_path / "other-settings")
    build_target(other, "sm_86", options=BuildConfig(detailed_profiling=False))
    ours = {t.name: t for t in read_manifest(first).targets}["sm_86"]
    theirs = {t.name: t for t in read_manifest(other).targets}["sm_86"]
    assert ours.engine is not None and theirs.engine is not None and ours.engine.sha256 != theirs.engine.sha256

    line = refused(out, first, other)
    assert f"part {other}: targets.sm_86.engine.sha256 is {theirs.engine.sha256[:12]}…, but part {first} " in line
    assert "build each target in one matrix job only" in line
    run_cli_json("merge", out, first)
    line = refused(out, other)
    assert f"part {other}: targets.sm_86.engine.sha256 is {theirs.engine.sha256[:12]}…, but OUT already has" in line


def test_a_part_without_a_new_target_is_refused(out: Path, compiled: Path, tmp_path: Path) -> None:
    untouched = copy_of(compiled, tmp_path / "untouched")  # its job's build never ran
    line = refused(out, untouched)
    assert f"part {untouched} adds no target: it has no built engine" in line
    assert "run `tensorsmith build PART --target X` in its job" in line


def test_a_part_whose_engine_is_damaged_is_refused(out: Path, parts: tuple[Path, Path], tmp_path: Path) -> None:
    part = copy_of(parts[1], tmp_path / "damaged")
    (part / "engines" / "sm_120.engine").write_bytes(b"not an engine")
    line = refused(out, parts[0], part)
    assert f"part {part}: target sm_120: {(part / 'engines' / 'sm_120.engine').resolve()} does not match" in line


def test_out_itself_a_part_given_twice_and_no_part_are_refused(out: Path, parts: tuple[Path, Path]) -> None:
    assert f"part {out} is OUT itself" in refused(out, out)
    assert f"part {parts[0]} is given twice" in refused(out, parts[0], parts[0])
    missing = out.parent / "missing"
    assert f"part {missing}: {missing / 'manifest.json'} does not exist" in refused(out, missing)
    usage = run_cli("merge", out)
    assert usage.exit_code == 2 and "Missing argument 'PARTS...'" in usage.stderr


def test_the_matrix_recipes_build_and_merge_commands_run(
    compiled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """samples/ci/engines-matrix.yml's `build` and `merge` lines as written, each build job in its own directory
    uploading what the recipe uploads, then the merge job's checks: nothing left pending."""
    import yaml

    from tests.test_ci_recipe import ENGINES_MATRIX, commands

    workflow = yaml.safe_load(ENGINES_MATRIX.read_text())
    found = commands(workflow)
    (build_argv,) = [argv for job, argv in found if job == "build"]
    (merge_argv,) = [argv for job, argv in found if argv[0] == "merge"]
    artifact, parts = Path(workflow["env"]["ARTIFACT"]), Path(workflow["env"]["PARTS"])
    matrix = workflow["jobs"]["build"]["strategy"]["matrix"]["target"]
    for target in matrix:
        job = tmp_path / f"build-{target}"
        shutil.copytree(compiled, job / artifact)
        monkeypatch.chdir(job)
        assert run_cli(*[word.replace("${{matrix.target}}", target) for word in build_argv]).exit_code == 0
        part = tmp_path / "merge" / parts / f"part-{target}"
        shutil.copytree(job / artifact / "engines", part / "engines")
        shutil.copy(job / artifact / "manifest.json", part)
    shutil.copytree(compiled, tmp_path / "merge" / artifact)
    monkeypatch.chdir(tmp_path / "merge")
    merged = run_cli(*[path for word in merge_argv for path in shell_glob(word)])
    assert merged.exit_code == 0, merged.stderr
    assert sorted(m["target"] for m in json.loads(merged.stdout)["added"]) == sorted(matrix)
    targets = run_cli_json("inspect", artifact)["targets"]
    assert [t["name"] for t in targets if t["status"] in ("pending", "failed")] == []
    assert {t["name"] for t in targets if t["status"] == "built"} == set(matrix)


def shell_glob(word: str) -> list[str]:
    """What bash makes of a word of a run step: its matches, sorted, where it has a `*`."""
    return sorted(str(path) for path in Path().glob(word)) if "*" in word else [word]
