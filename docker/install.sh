#!/bin/sh
# The server's installation, one place for both images (Dockerfile, Dockerfile.gpu) and for the test that runs
# the same steps in a virtual environment (tests/serve/test_container.py): tensorsmith from SOURCE with the
# serving extra and a backend's extra, no torch.
#
#   PYTHON=/opt/venv/bin/python sh docker/install.sh SOURCE [EXTRAS]     # EXTRAS: serve,cpu (default) or serve,gpu
set -eu
source_folder="${1:?usage: install.sh SOURCE [EXTRAS]}"
extras="${2:-serve,cpu}"
python="${PYTHON:-python3}"
"$python" -m pip install --no-cache-dir --no-compile "${source_folder}[${extras}]"
# what a serving image must not carry: torch (the runtime and the server import neither it nor the compiler)
if "$python" -c "import torch" 2>/dev/null; then
    echo "install.sh: torch was installed with tensorsmith[${extras}]; the serving image must not need it" >&2
    exit 1
fi
"$python" -m tensorsmith.cli.main serve --help >/dev/null
