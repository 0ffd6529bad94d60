# CMEMI — two commands on a fresh machine:  make demo   and   make test
#
# torch: CPU machines get torch==$(TORCH_VERSION) (a CPU build where pip finds one). GPU users install
# their CUDA torch into .venv first (python3 -m venv .venv && .venv/bin/pip install torch ...):
# a torch already importable in .venv is kept as it is.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install dev demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "keeping torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')" \
		|| $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install --quiet -e ".[examples]"
	@touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev]"
	@touch $@

install: $(VENV)/.installed

dev: $(VENV)/.dev

demo: install
	$(BIN)/cmemi up examples/digits.yaml --overwrite

test: dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
