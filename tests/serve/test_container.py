"""The CPU image's steps, run as docker/Dockerfile says, in a fresh virtual environment instead of an image (no
container runtime here): its COPY lines into a folder, its install RUN line, its entry point against a real
artifact, on loopback. The Dockerfiles' own lint is `make lint`'s hadolint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.serve.server import Server, free_port, serving

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines]


@pytest.mark.slow
def test_the_cpu_images_steps_install_a_torch_free_server_that_answers(
    tinylm_cpu_artifact: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "image"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    entrypoint: list[str] = []
    for instruction, arguments in _instructions():
        if instruction == "COPY":
            *sources, destination = arguments.split()
            for source in sources:
                target = workdir / destination if destination != "./" else workdir / Path(source).name
                target.parent.mkdir(parents=True, exist_ok=True)
                copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy
                copy(ROOT / source, target)
        elif instruction == "RUN":
            install = arguments.split("&&")[0].strip()  # the install; the user it adds is the image's business
            assert install.startswith("sh docker/install.sh"), install
            result = subprocess.run(["sh", "-c", install], cwd=workdir, env={"PYTHON": str(python), "PATH":
                                    "/usr/bin:/bin"}, capture_output=True, text=True)  # fmt: skip
            assert result.returncode == 0, result.stderr[-3000:]
        elif instruction == "ENTRYPOINT":
            entrypoint = [str(part) for part in json.loads(arguments)]  # a JSON array, as hadolint asks
    assert entrypoint[:3] == ["tensorsmith", "serve", "/model"]
    imported = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    assert imported.returncode != 0  # torch-free: the image holds the runtime and the server, not the compiler's
    command = [str(venv / "bin" / "tensorsmith"), "serve", str(tinylm_cpu_artifact), *entrypoint[3:]]
    command[command.index("--host") + 1] = "127.0.0.1"  # loopback only, here
    command[command.index("--port") + 1] = str(free_port())
    with serving(tinylm_cpu_artifact, command=command) as server:
        _answers(server)


def _answers(server: Server) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    name = client.models.list().data[0].id  # the artifact folder's name
    reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
