# megatron-charm: set up, run, test. Every target creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-attention test test-all test-slurm lint format testbed-setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev]'
	# The outside baseline of the attention benchmark; --no-deps: it declares a CUDA torch.
	$(PY) -m pip install -q --no-deps ring-flash-attn==0.1.8
	touch $(STAMP)

setup: $(STAMP)

## The main job: a tiny GPT trained with CHARM+ (CP = 4) on 4 CPU ranks.
demo: setup
	$(VENV)/bin/megatron-charm-train --config configs/gpt-tiny-cpu.yaml

## CP attention alone on 4 CPU ranks (2 nodes x 2), compared with the single-process result.
demo-attention: setup
	$(PY) -m megatron_charm.demo

## The default suite (what CI runs).
test: setup
	$(PY) -m pytest -q

## Also the real-Slurm launcher test (root; installs slurm-wlm and munge with apt).
test-slurm: setup
	MEGATRON_CHARM_SLURM_TEST=1 $(PY) -m pytest -q -m slurm tests/launch/test_slurm.py

testbed-setup:
	bash scripts/testbed/setup.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
