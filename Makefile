# dhp developer commands. Each creates the environment itself if needed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "CUDA machine: installing torch with its default (CUDA) build"; \
	  $(BIN)/python -m pip install -q torch; \
	  $(BIN)/python -m pip install -q -e '.[dev,gpu]'; \
	else \
	  echo "CPU machine: installing torch==$(TORCH_VERSION) (CPU wheel) first"; \
	  $(BIN)/python -m pip install -q torch==$(TORCH_VERSION); \
	  $(BIN)/python -m pip install -q -e '.[dev]'; \
	fi
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

demo: install
	$(BIN)/dhp train conf=tiny_vlm

lint: install
	$(BIN)/ruff check dhp tests scripts

clean:
	rm -rf $(VENV) runs .pytest_cache
