# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
PIP := $(BIN)/pip install -q --disable-pip-version-check
PYTEST_ARGS ?=
DEMO_OUT ?= demo_output

.PHONY: venv demo test bench test-oldest clean

venv: $(STAMP)

# Idempotent: re-runs only when the pins or pyproject change. torch is pinned by the constraints file on
# every install after the first, because any other torch version pulls gigabytes of CUDA packages.
$(STAMP): pyproject.toml setup.py msprobe_core/pytorch/_fast_stats.c requirements/dev.txt $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c $(CONSTRAINTS) -r requirements/dev.txt
	DS_BUILD_OPS=0 $(PIP) -c $(CONSTRAINTS) deepspeed==0.19.8
	$(PIP) -c $(CONSTRAINTS) --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: venv
	$(BIN)/python recipes/hf_trainer.py --output-dir $(DEMO_OUT) --steps 6 --nan-at-step 6

test: venv
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

bench: venv
	$(BIN)/python benchmarks/dump_overhead.py
	$(BIN)/python benchmarks/monitor_overhead.py
	$(BIN)/python benchmarks/compare_speed.py

# The lowest torch pyproject.toml declares, with the core's test dependencies only (no frameworks: their tests
# skip): the dump, monitor and compare suites against it. Not part of `make test`: PyPI's torch of that age is a
# CUDA build (about 3 GB with its nvidia packages), so this venv takes minutes and disk space.
OLDEST_TORCH ?= 2.6.0
OLDEST_VENV := .venv-oldest
test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check torch==$(OLDEST_TORCH)
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/oldest.txt
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(OLDEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(DEMO_OUT)
