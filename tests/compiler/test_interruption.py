"""Killed and concurrent compiles: the previous artifact stays whole and loadable, a second writer into the same
OUT fails at once, and the temporary directories a killed compile leaves are removed by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import numpy as np
import pytest

from tensorsmith.runtime import load
from tests.conftest import small_mlp_onnx

STAGES = ["exporting", "running graph passes", "verifying", "building the sm_86 engine", "writing the report"]


def compile_command(source: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "tensorsmith.cli.main", "compile", str(source), "--input", "x:float32:batch,8",
            "-o", str(out), "--target", "cpu", "--target", "sm_86", "--json"]  # fmt: skip


def start(source: Path, out: Path) -> subprocess.Popen[str]:
    """The compile in its own process; its temporary files (an engine build's, which a SIGKILL leaves) under
    the test's directory, not the machine's /tmp."""
    scratch = out.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    environment = {**os.environ, "TMPDIR": str(scratch)}
    return subprocess.Popen(compile_command(source, out), stdout=PIPE, stderr=PIPE, text=True, env=environment)


def kill_at_stage(process: subprocess.Popen[str], stage: str) -> bool:
    """SIGKILL `process` as soon as it logs `stage`; False if it finished first."""
    assert process.stderr is not None
    for line in process.stderr:
        if stage in line:
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
    process.wait()
    return False


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(path.relative_to(out)): path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if path.name.startswith(f".{name}."))


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes], np.ndarray]:
    """A published artifact (from one model) and the source of a different model to recompile into it."""
    old_source = small_mlp_onnx(tmp_path / "old.onnx", opset=17)
    out = tmp_path / "out"
    assert subprocess.run(compile_command(old_source, out), capture_output=True).returncode == 0
    with load(out) as model:
        reference = model.run({"x": np.ones((3, 8), np.float32)})["y"]
    new_source = tmp_path / "new.onnx"
    import torch

    torch.manual_seed(1)  # other weights: a half-published artifact would show as other outputs
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    torch.onnx.export(module, (torch.randn(2, 8),), str(new_source), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"])  # fmt: skip
    return out, new_source, snapshot(out), reference


def assert_intact(out: Path, before: dict[str, bytes], reference: np.ndarray) -> None:
    assert snapshot(out) == before
    with load(out) as model:
        np.testing.assert_array_equal(model.run({"x": np.ones((3, 8), np.float32)})["y"], reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_compile_killed_at_any_stage_leaves_the_previous_artifact(
    previous: tuple[Path, Path, dict[str, bytes], np.ndarray], stage: str
) -> None:
    out, new_source, before, reference = previous
    assert kill_at_stage(start(new_source, out), stage), f"the compile finished before '{stage}'"
    assert_intact(out, before, reference)

    # The next compile removes what the killed one left and publishes normally.
    finished = subprocess.run(compile_command(new_source, out), capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert leftovers(out.parent, "out") == []
    with load(out) as model:
        assert not np.array_equal(model.run({"x": np.ones((3, 8), np.float32)})["y"], reference)


def wait_for_stage(process: subprocess.Popen[str], stage: str) -> float:
    """Block until `process` logs `stage`; the time it did."""
    assert process.stderr is not None
    for line in process.stderr:
        if stage in line:
            return time.perf_counter()
    raise AssertionError(f"the compile ended without logging '{stage}'")


@pytest.mark.slow
def test_kills_at_arbitrary_moments_never_lose_the_artifact(
    previous: tuple[Path, Path, dict[str, bytes], np.ndarray],
) -> None:
    """SIGKILL at fractions of the work (from the first stage to the exit): each leaves the previous artifact
    whole, or, once the new one is published, the new one whole."""
    out, new_source, before, reference = previous
    timing = start(new_source, out.parent / "timing")
    began = wait_for_stage(timing, "exporting")
    timing.communicate()
    work = time.perf_counter() - began
    survived = 0
    for fraction in (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 1.0):
        process = start(new_source, out)
        wait_for_stage(process, "exporting")
        time.sleep(work * fraction)
        process.send_signal(signal.SIGKILL)
        process.communicate()
        if snapshot(out) != before:  # it published before the kill landed: the new artifact, whole
            with load(out) as model:
                assert not np.array_equal(model.run({"x": np.ones((3, 8), np.float32)})["y"], reference)
            break
        assert_intact(out, before, reference)
        survived += 1
    print(f"timed kills: {survived} landed before publishing, every one left the previous artifact whole")
    assert survived >= 3


@pytest.mark.slow
def test_two_compiles_into_one_out_one_wins_the_other_fails_clearly(
    previous: tuple[Path, Path, dict[str, bytes], np.ndarray],
) -> None:
    out, new_source, _, reference = previous
    first = start(new_source, out)
    assert first.stderr is not None
    for line in first.stderr:  # the first holds the lock once it logs its first stage
        if "exporting" in line:
            break
    # paused while the second runs: a tiny compile can otherwise finish before the second's imports reach the lock
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(compile_command(new_source, out), capture_output=True, text=True)
    finally:
        first.send_signal(signal.SIGCONT)
    first.communicate()
    assert first.returncode == 0
    assert second.returncode == 1
    error = second.stderr.strip().splitlines()[-1]
    assert "is being replaced by a tensorsmith compile (pid" in error and "hint:" in error
    with load(out) as model:  # the winner's artifact, whole
        assert not np.array_equal(model.run({"x": np.ones((3, 8), np.float32)})["y"], reference)
    assert leftovers(out.parent, "out") == []


def test_a_temporary_directory_still_being_written_is_not_removed(tmp_path: Path) -> None:
    from tensorsmith.compiler.artifact.staging import remove_stale_staging, staged_artifact

    out = tmp_path / "out"
    with staged_artifact(out) as staging:
        (staging / "manifest.json").write_text("{}")
        assert remove_stale_staging(out) == []  # its owner (this process) is alive
        assert staging.is_dir()
    dead = tmp_path / ".out.tmp-killed"
    dead.mkdir()
    (dead / "model.onnx").write_bytes(b"half")
    assert remove_stale_staging(out) == [dead]


@pytest.mark.slow
def test_compile_and_build_exclude_each_other_builds_share(
    previous: tuple[Path, Path, dict[str, bytes], np.ndarray],
) -> None:
    from tensorsmith.compiler.artifact.staging import artifact_lock
    from tests.conftest import run_cli

    out, new_source, before, reference = previous
    with artifact_lock(out, shared=True), artifact_lock(out, shared=True):  # builds in progress
        compiling = subprocess.run(compile_command(new_source, out), capture_output=True, text=True)
    assert compiling.returncode == 1
    assert "is being changed by a tensorsmith build" in compiling.stderr.strip().splitlines()[-1]
    assert_intact(out, before, reference)

    with artifact_lock(out):  # a compile in progress
        building = run_cli("build", out, "--target", "sm_89")
    assert building.exit_code == 1 and "is being replaced by a tensorsmith compile (pid" in building.stderr
    assert_intact(out, before, reference)
    assert leftovers(out.parent, "out") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_compile_stopped_in_an_engine_build_cleans_up_and_says_so(tmp_path: Path, signum: signal.Signals) -> None:
    """SIGTERM (a cancelled CI job) or Ctrl-C in the middle of an engine build: the builder's child process and
    its temporary directory go, nothing is published, one line says why, and the status is 128 + the signal."""
    source = small_mlp_onnx(tmp_path / "model.onnx", opset=17)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "out"
    environment = {**os.environ, "TMPDIR": str(scratch)}
    # Ctrl-C's default action restored: a job started in the background (`make test &`, some CI runners) has SIGINT
    # ignored, which its children inherit, and Python then leaves it ignored
    process = subprocess.Popen(
        compile_command(source, out),
        stdout=PIPE,
        stderr=PIPE,
        text=True,
        env=environment,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    assert process.stderr is not None
    for line in process.stderr:
        if "building the sm_86 engine" in line:
            break
    while not any(scratch.glob("tensorsmith-build-*")):  # the builder's child is running
        time.sleep(0.05)
    process.send_signal(signum)
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, errors
    assert [line for line in errors.splitlines() if line.startswith("error:")] == [
        "error: terminated (SIGTERM)" if signum == signal.SIGTERM else "error: interrupted"
    ]
    assert not list(scratch.glob("tensorsmith-*")) and not out.exists() and leftovers(tmp_path, "out") == []
