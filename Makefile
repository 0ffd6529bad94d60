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

.PHONY: install dev demo test chaos-test soak lint docs bench clean system-packages known-bugs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "keeping torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')" \
		|| $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install --quiet -e ".[all]"
	@touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev]"
	@touch $@

$(VENV)/.docs: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	@touch $@

$(VENV)/.bench: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[all,bench]"
	@touch $@

install: $(VENV)/.installed

dev: $(VENV)/.dev

demo: install
	$(BIN)/cmemi up examples/digits.yaml --overwrite

# Debian packages tests drive for real, installed when missing (scripts/system_packages.sh; root or sudo):
# chromium for tests/test_dashboard_browser.py, prometheus for tests/test_prometheus.py, iptables for the emulated
# hosts' port outages and partitions (tests/helpers/netns_cluster.py: test_netns*, test_partitions*, test_soak).
SYSTEM_PACKAGES ?= chromium prometheus iptables

system-packages:
	bash scripts/system_packages.sh $(SYSTEM_PACKAGES)

test: dev system-packages
	$(BIN)/python -m pytest -m "not known_bug" $(PYTEST_ARGS)

# The tests that reproduce open bugs (marked known_bug, each naming its bug): expected to fail until fixed.
known-bugs: dev system-packages
	$(BIN)/python -m pytest -m known_bug $(PYTEST_ARGS)

# The 30-fault chaos run alone (tests/test_chaos.py; also part of `make test`).
chaos-test: dev
	$(BIN)/python -m pytest -m chaos $(PYTEST_ARGS)

# Issue 47's soak: >= 1,000 faults of every kind across 7 emulated hosts (network namespaces; root), K = 2, in one
# run; prints the counts, steps redone and params_sha256 against `cmemi reference`, writes bench/results/soak.json,
# exits 1 unless bitwise equal. Bounded by SOAK_ARGS' --deadline (default 2400 s). A 48-fault version is
# tests/test_soak.py.
SOAK_ARGS ?=

soak: dev
	$(BIN)/python bench/soak.py $(SOAK_ARGS)

# ruff; the layering rules (no import cycle, no private name across modules, services never import each other,
# shared/ no service: scripts/check_imports.py); mypy, strict on cmemi.shared and check_untyped_defs elsewhere
# (pyproject.toml [tool.mypy]; scripts/typecheck.py lays the package out as installed).
lint: dev
	$(BIN)/ruff check .
	$(BIN)/python scripts/check_imports.py
	$(BIN)/python scripts/typecheck.py -p cmemi

# The manual (mkdocs.yml, docs/) into site/: --strict fails on a broken link or anchor and on a page left out of the
# navigation. Its generated blocks are checked by tests/test_readme.py (`make test`).
docs: $(VENV)/.docs
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs .pytest_cache site

# Build the image and run the compose cluster end to end with a worker killed mid-run (root; starts and
# stops its own dockerd). See scripts/compose_test.sh.
.PHONY: compose-test
compose-test:
	bash scripts/compose_test.sh

# docker/stack.yml on a single-node swarm (root; its own dockerd): workers scaled, one killed, the run must end
# with the fault-free params_sha256. Reuses compose-test's image (builds it through compose-test if missing).
.PHONY: swarm-test
swarm-test:
	bash scripts/swarm_test.sh

# Benchmarks (bench/*.py, quick settings, about 10-15 min on 2 cores): each prints one JSON object,
# saved to bench/results/NAME.json and printed, with the commit (and dirty flag) and UTC date it measured.
# BENCHES=... picks a subset; BENCH_ARGS=... adds flags. Re-measuring every results file (cluster.py, curve.py,
# scripts/resnet_accuracy.py too) and regenerating the manual's tables: bench/README.md, "Re-measuring everything".
BENCHES ?= overhead transport recovery torchft_recovery checkpoint scaling compression small
BENCH_ARGS ?= --quick
bench: $(VENV)/.bench
	@mkdir -p bench/results; rc=0; start=$$(date +%s); \
	for b in $(BENCHES); do \
		echo "== $(BIN)/python bench/$$b.py $(BENCH_ARGS)" >&2; \
		if timeout -k 15 900 $(BIN)/python bench/$$b.py $(BENCH_ARGS) > bench/results/$$b.json.tmp; then \
			mv bench/results/$$b.json.tmp bench/results/$$b.json; \
		else echo "bench/$$b.py failed" >&2; mv bench/results/$$b.json.tmp bench/results/$$b.json; rc=1; fi; \
		cat bench/results/$$b.json; \
	done; \
	echo "make bench: $$(( $$(date +%s) - start )) s" >&2; exit $$rc
