# `make demo` and `make test` each create .venv and install the pinned CPU set first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint typecheck bench clean gpu-check

$(STAMP): requirements-ci.txt setup.cfg
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-ci.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m examples.demo --output_dir demo_out

# Default run: ruff, mypy on the package, then unit + integration + 2-process DDP tests (`slow` ones: test-all).
test: $(STAMP)
	$(BIN)/ruff check hf_dynamic_ckpt examples tests scripts recipes
	$(BIN)/mypy hf_dynamic_ckpt
	$(BIN)/python -m pytest -m "not slow and not gpu" -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -q

lint: $(STAMP)
	$(BIN)/ruff check hf_dynamic_ckpt examples tests scripts recipes
	$(BIN)/mypy hf_dynamic_ckpt

# The GPU checks (scripts/gpu_check.py, at most 5 minutes on one GPU). Not on $(STAMP): the pinned set's torch
# is CPU-only, so this uses .venv as it is (install a CUDA build of torch there); without a GPU it exits 77.
gpu-check:
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf $(VENV) demo_out bench_out .pytest_cache
