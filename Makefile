# dhp developer commands. Each creates the environment itself if needed.
#   make install        .venv with torch pinned first, then dhp[dev]
#   make install GPU=1  on a CUDA machine, also the [gpu] extra (flash-attn, flash-linear-attention, causal-conv1d; compiles for long)
#   make test           the import contracts (lint-imports), then the whole suite (what CI runs through .ci/run)
#   make test-fast      the import contracts, then the suite without the tests marked slow
#   make demo           the tiny VLM trains on real photographs on this machine
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
GPU ?= 0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "installing torch==$(TORCH_VERSION) first (the build the package index serves for this machine)"
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[dev]'
	@if [ "$(GPU)" = "1" ]; then \
	  echo "GPU=1: installing the [gpu] extra (flash-attn, flash-linear-attention, causal-conv1d)"; \
	  $(BIN)/python -m pip install -q --no-build-isolation -e '.[dev,gpu]'; \
	fi
	touch $(STAMP)

test: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -m "not slow"

# The tiny random Qwen2.5-VL learns to caption the shipped real photographs on this machine:
# its plan first, then 30 steps of training (vision SP=2 + LLM TP=2 over gloo, about a minute).
TINY_CKPT := runs/tiny_qwen
demo: install
	test -f $(TINY_CKPT)/config.json || $(BIN)/python scripts/make_tiny_checkpoint.py --out $(TINY_CKPT)
	$(BIN)/dhp plan conf=tiny_vlm_demo model.path=$(TINY_CKPT) --dry-run
	$(BIN)/dhp train conf=tiny_vlm_demo model.path=$(TINY_CKPT)

lint: install
	$(BIN)/ruff check dhp tests scripts
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs .pytest_cache .grimp_cache .import_linter_cache
