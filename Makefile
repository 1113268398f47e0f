# megatron-charm: set up, run, test. Every target creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-attention test test-all test-slurm test-megatron-0.19 lint format \
	testbed-setup clean

# The second line: Python 3.12 with megatron-core 0.19.x (0.16.1 is the newest for Python 3.11).
# PYTHON_MC019: python3.12 on PATH, else pyenv's newest 3.12.
PYTHON_MC019 ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; \
	do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' \
	2>/dev/null && break; done)
VENV_MC019 ?= .venv-mc019
STAMP_MC019 := $(VENV_MC019)/.installed
# The Megatron tier: core_attention contract and spec helpers, CHARM+ module, CP equivalence and
# group building on CPU gloo ranks, trainer smoke test, Megatron-LM argument rules and
# patch-megatron; with MEGATRON_LM_PATH set, also the patched validate_args of that checkout.
MEGATRON_TIER := tests/pure/test_spec_and_compat.py tests/pure/test_megatron_core_pin.py \
	tests/integration tests/launch/test_megatron_args.py tests/launch/test_patch_megatron.py \
	tests/launch/test_megatron_lm_checkout.py

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev]'
	# The outside baselines of the attention benchmark; --no-deps: they declare CUDA packages
	# (a CUDA torch, flash-attn), which the CPU flash-attn shim stands in for.
	$(PY) -m pip install -q --no-deps ring-flash-attn==0.1.8 yunchang==0.6.4
	touch $(STAMP)

setup: $(STAMP)

## The main job: a tiny GPT trained with CHARM+ (CP = 4) on 4 CPU ranks.
demo: setup
	$(VENV)/bin/megatron-charm-train --config configs/gpt-tiny-cpu.yaml

## CP attention alone on 4 CPU ranks (2 nodes x 2), compared with the single-process result.
demo-attention: setup
	$(PY) -m megatron_charm.demo

## The default suite (what CI runs first).
test: setup
	$(PY) -m pytest -q

## The long end-to-end runs the default suite leaves out (CI runs them next).
test-heavy: setup
	$(PY) -m pytest -q -m heavy

$(STAMP_MC019): pyproject.toml
	@test -n "$(PYTHON_MC019)" || { echo "no Python 3.12 found: pass PYTHON_MC019=/path/to/python3.12"; exit 1; }
	rm -rf $(VENV_MC019)
	$(PYTHON_MC019) -m venv $(VENV_MC019)
	$(VENV_MC019)/bin/python -m pip install -q --upgrade pip
	# No CPU build of torch for 3.12 here: the registry's CUDA build (it runs on CPU).
	$(VENV_MC019)/bin/python -m pip install -q torch==2.13.0
	# pyproject.toml's marker picks megatron-core 0.19.x on Python 3.12.
	$(VENV_MC019)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP_MC019)

## The Megatron tier on Python 3.12 + megatron-core 0.19.x (its own venv, .venv-mc019).
test-megatron-0.19: $(STAMP_MC019)
	$(VENV_MC019)/bin/python -m pytest -q -p no:cacheprovider -m 'not slow and not slurm' \
		$(MEGATRON_TIER)

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
	rm -rf $(VENV) $(VENV_MC019) .pytest_cache .ruff_cache runs
