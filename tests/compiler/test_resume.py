"""A compile killed (SIGKILL) in the middle of AWQ's search resumes from the activations it finished and publishes
the artifact an uninterrupted compile publishes, bit for bit (compiler/variants/resume.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compiler.test_decoder_quantization import TINYLM

COMPILE = """
import json, os, signal, sys
from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.variants import awq_layers

kill_at, searched = int(sys.argv[2]), []
search_scale = awq_layers.search_scale

def counted(*args, **kwargs):
    searched.append(1)
    if len(searched) == kill_at:  # as the kernel or a CI timeout would: no cleanup, no exception
        os.kill(os.getpid(), signal.SIGKILL)
    return search_scale(*args, **kwargs)

awq_layers.search_scale = counted
text = sys.argv[3]
# a layer at a time, as a model the machine's size runs: its reference outputs spilled to disk through AWQ too
config = {"source": sys.argv[4], "targets": ["cpu"], "precision": "int4", "int4_algorithm": "awq",
          "calibration": text, "calibration_samples": 16, "evaluation": text, "layerwise": "always"}
manifest = compile(CompileConfig.create(config), sys.argv[1]).manifest
print(json.dumps({"searched": len(searched), "variants": {v.name: v.sha256 for v in manifest.variants}}))
"""


def _compile(out: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    text, checkpoint = TINYLM / "heldout.txt", TINYLM / "checkpoint"
    return subprocess.run([sys.executable, "-c", COMPILE, str(out), str(kill_at), str(text), str(checkpoint)],
                          capture_output=True, text=True)  # fmt: skip


@pytest.mark.slow
def test_a_compile_killed_in_awq_s_search_resumes_with_the_same_artifact(tmp_path: Path) -> None:
    whole = _compile(tmp_path / "whole", kill_at=0)
    assert whole.returncode == 0, whole.stderr
    uninterrupted = json.loads(whole.stdout.splitlines()[-1])
    activations = uninterrupted["searched"]
    assert activations > 6 and not (tmp_path / ".whole.resume").exists()  # published: the records are gone

    killed = _compile(tmp_path / "out", kill_at=6)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()  # nothing published
    kept = list((tmp_path / ".out.resume").glob("*/awq*.npz"))
    assert len(kept) == 5  # the activations searched before the kill

    resumed = _compile(tmp_path / "out", kill_at=0)
    assert resumed.returncode == 0, resumed.stderr
    figures = json.loads(resumed.stdout.splitlines()[-1])
    assert figures["searched"] == activations - 5  # nothing done twice
    assert figures["variants"] == uninterrupted["variants"]  # nothing lost: the same files
    assert not (tmp_path / ".out.resume").exists()
