# duet developer targets. Everything installs into .venv/ inside the repo.
#
# torch: where no GPU is present the install takes a CPU build (TORCH_SPEC, default torch==2.13.0,
# which lies on this kind of machine's disk) and then asserts torch.version.cuda is None, so a
# multi-GB CUDA build is never pulled onto a CPU-only machine. Elsewhere set TORCH_SPEC and, for a
# CPU wheel index, TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu. With a GPU (nvidia-smi -L
# succeeds) the default is the normal CUDA build of torch.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_INDEX_URL ?=
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
PYTEST_ARGS ?=
# The suite runs in this many pytest-xdist workers, each taking whole test modules (--dist loadfile:
# a module shares one local Ray cluster among its tests). On a 2-core machine two take the suite
# from 21 to 13 minutes: much of a Ray test is waiting (cluster start, actors, timeouts), not
# computing. Every test cluster binds its own ports (tests/integration/cluster_harness.py,
# test_ray_job_submit.py), so two run side by side. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: demo install test test-unit test-integration test-chaos lint replay demo bench-quick proto clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX_ARGS)
	@if [ "$(HAS_GPU)" = "0" ]; then \
	  $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 'refusing: a CUDA build of torch (' + torch.__version__ + ') on a machine without a GPU')"; \
	fi
	$(PIP) install --quiet -e ".[dev]"
	@if [ "$(HAS_GPU)" = "0" ]; then \
	  $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 'refusing: the install replaced torch with a CUDA build (' + torch.__version__ + ')')"; \
	fi
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST) tests $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST) tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST) tests/integration $(PYTEST_ARGS)

test-chaos: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST) tests/chaos $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

# The quick-start job: an embedded cluster (1 PREFILL + 1 GENERATION, the built-in model) serving a
# mixed batch of requests through the gRPC client API.
demo: $(STAMP)
	$(VENV)/bin/duet demo

# Replays TensorRT-LLM's scheduler peer cases; needs nothing but the system python3.
replay:
	$(PYTHON) -m scheduler.replay

proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
