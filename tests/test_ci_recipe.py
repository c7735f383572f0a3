"""samples/ci/engines.yml: a GitHub Actions workflow whose jobs chain compile → hopper → publish; samples/ci/
calibration.yml: shard jobs of a matrix, then one merge-and-compile job; samples/ci/engines-matrix.yml: compile,
one engine build job a target, then one merge job. Every `tensorsmith` command line in them parses with this CLI
(flags and commands that exist); tests/compiler/test_merge.py runs the matrix recipe's commands for real."""

import shlex
from pathlib import Path

import click
import yaml

from tensorsmith.cli.main import main

WORKFLOW = Path(__file__).resolve().parents[1] / "samples" / "ci" / "engines.yml"
CALIBRATION = WORKFLOW.with_name("calibration.yml")
ENGINES_MATRIX = WORKFLOW.with_name("engines-matrix.yml")


def commands(workflow: dict) -> list[tuple[str, list[str]]]:
    """(job, argv) for every `tensorsmith ...` line of every run step, with the workflow's env expanded."""
    env = {name: str(value) for name, value in workflow["env"].items()}
    found = []
    for job_name, job in workflow["jobs"].items():
        for step in job["steps"]:
            for line in str(step.get("run", "")).splitlines():  # a folded (>) command is one line already
                words = shlex.split(line.split(" > ")[0].strip())
                if words and words[0] == "tensorsmith":
                    found.append((job_name, [_expand(word, env) for word in words[1:]]))
    return found


def _expand(word: str, env: dict[str, str]) -> str:
    for name, value in env.items():
        word = word.replace(f"${name}", value)
    return word


def assert_parses(found: list[tuple[str, list[str]]]) -> None:
    for job, argv in found:
        with click.Context(main) as context:
            name, command, rest = main.resolve_command(context, argv)
            assert command is not None, (job, argv)
            command.make_context(name or "", rest, parent=context)  # raises UsageError on a bad flag


def test_jobs_chain_compile_then_hopper_then_publish() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    jobs = workflow["jobs"]
    assert list(jobs) == ["compile", "hopper", "publish"]
    assert jobs["hopper"]["needs"] == "compile" and jobs["publish"]["needs"] == "hopper"
    assert "h100" in jobs["hopper"]["runs-on"]


def test_every_tensorsmith_command_in_the_workflow_parses() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    found = commands(workflow)
    names = [argv[0] for _, argv in found]
    assert {"compile", "build", "run", "inspect", "report"} <= set(names)
    for job, argv in found:
        with click.Context(main) as context:
            name, command, rest = main.resolve_command(context, argv)
            assert command is not None, (job, argv)
            command.make_context(name or "", rest, parent=context)  # raises UsageError on a bad flag
    compile_argv = next(argv for _, argv in found if argv[0] == "compile")
    assert compile_argv[compile_argv.index("--target", compile_argv.index("sm_120")) + 1] == "sm_90"
    build_argv = next(argv for job, argv in found if argv[0] == "build")
    assert build_argv[1:] == ["build/model", "--target", "sm_90", "--builder", "tensorrt", "--json"]


def test_the_calibration_matrix_shards_then_merges_with_the_same_graph() -> None:
    workflow = yaml.safe_load(CALIBRATION.read_text())
    jobs = workflow["jobs"]
    assert list(jobs) == ["calibrate", "compile"] and jobs["compile"]["needs"] == "calibrate"
    assert len(jobs["calibrate"]["strategy"]["matrix"]["shard"]) == int(workflow["env"]["SHARDS"])
    found = commands(workflow)
    for job, argv in found:
        with click.Context(main) as context:
            name, command, rest = main.resolve_command(context, argv)
            assert command is not None, (job, argv)
            command.make_context(name or "", rest, parent=context)
    (calibrate,) = [argv for _, argv in found if argv[0] == "calibrate"]
    (compile_argv,) = [argv for _, argv in found if argv[0] == "compile"]
    assert "--shard" in calibrate and "--calibration-stats" in compile_argv and "--calibration" not in compile_argv

    def targets(argv: list[str]) -> list[str]:
        return [argv[index + 1] for index, word in enumerate(argv) if word == "--target"]

    assert targets(calibrate) == targets(compile_argv)  # the same fused graph


def test_the_engines_matrix_builds_each_target_in_its_own_job_then_merges() -> None:
    from tensorsmith.compiler.targets import RTX_TARGETS

    workflow = yaml.safe_load(ENGINES_MATRIX.read_text())
    jobs = workflow["jobs"]
    assert list(jobs) == ["compile", "build", "merge"]
    assert jobs["build"]["needs"] == "compile" and jobs["merge"]["needs"] == "build"
    matrix = jobs["build"]["strategy"]["matrix"]["target"]
    found = commands(workflow)
    assert_parses(found)
    (compile_argv,) = [argv for job, argv in found if argv[0] == "compile"]
    (build_argv,) = [argv for job, argv in found if job == "build"]
    (merge_argv,) = [argv for job, argv in found if argv[0] == "merge"]
    compiled = [compile_argv[index + 1] for index, word in enumerate(compile_argv) if word == "--target"]
    assert compiled == ["cpu", *matrix]  # each job builds a target whose variant the compile made
    assert set(matrix) <= set(RTX_TARGETS)  # built on the CPU runner the job names
    assert build_argv == ["build", "build/model", "--target", "${{matrix.target}}", "--json"]
    assert merge_argv == ["merge", "build/model", "parts/part-*", "--json"]
    # the compile job installs no engine builder (so its GPU targets are pending); each build job does
    installs = {name: " ".join(str(step.get("run", "")) for step in job["steps"]) for name, job in jobs.items()}
    assert "rtx" not in installs["compile"] and "[rtx]" in installs["build"]
    # each part is uploaded under the name the merge job downloads, one folder a part
    upload = next(step for step in jobs["build"]["steps"] if "upload-artifact" in step.get("uses", ""))
    download = [step for step in jobs["merge"]["steps"] if "download-artifact" in step.get("uses", "")]
    assert upload["with"]["name"] == "part-${{matrix.target}}"
    assert upload["with"]["path"].splitlines() == ["${{ env.ARTIFACT }}/manifest.json", "${{ env.ARTIFACT }}/engines/"]
    assert any(step["with"].get("pattern") == "part-*" and "merge-multiple" not in step["with"] for step in download)
