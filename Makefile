# Quick start: `make demo` (upload + stream back on an embedded S3 server) and `make test`.
# Each creates or updates .venv; the CPU build of torch is installed first so that no
# dependency pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# PyTorch's CPU wheels: PyPI's Linux torch is the multi-GB CUDA build. Another build:
# make TORCH_INDEX=https://download.pytorch.org/whl/cu130 (a local wheelhouse in pip's
# find-links is used too, when the index cannot be reached).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed
# torchvision's build for $(TORCH), from the same index; and where it cannot load beside it
# anyway, the module that lets it import (the module's docstring says how).
TORCHVISION := torchvision==0.28.0
OPS_HOOK := remote_loader_torchvision_ops
SITE = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BENCH_STAMP := $(VENV)/.bench-installed
PEERS := mosaicml-streaming==0.13.0 litdata==0.2.76

.PHONY: demo test lint docs venv clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml Makefile tools/$(OPS_HOOK).py | $(BIN)/python
	$(BIN)/python -m pip install --quiet --retries 1 --index-url $(TORCH_INDEX) $(TORCH)
	$(BIN)/python -m pip install --quiet --retries 1 --no-deps --index-url $(TORCH_INDEX) $(TORCHVISION) \
		|| echo 'no $(TORCHVISION) at $(TORCH_INDEX): the test extra installs it from the package index'
	echo '$(TORCH)' > $(VENV)/constraints.txt
	$(BIN)/python -m pip install --quiet -c $(VENV)/constraints.txt -e '.[test]'
	rm -f $(SITE)/$(OPS_HOOK).pth $(SITE)/$(OPS_HOOK).py $(SITE)/__pycache__/$(OPS_HOOK).*
	$(BIN)/python -c 'import torchvision' 2>/dev/null || { \
		cp tools/$(OPS_HOOK).py $(SITE)/ && $(BIN)/python -m py_compile $(SITE)/$(OPS_HOOK).py && \
		echo 'import $(OPS_HOOK)' > $(SITE)/$(OPS_HOOK).pth && \
		echo "torchvision's C++ library does not load beside $(TORCH): installed $(OPS_HOOK).pth," \
			"which declares the two operators torchvision needs to import (tools/$(OPS_HOOK).py)"; }
	$(BIN)/python -c 'import torchvision; from torchvision import tv_tensors; print("torchvision", torchvision.__version__, "imports")'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check remote_loader tests examples benchmarks tools
	$(BIN)/lint-imports
	$(BIN)/mypy

# The docs site, warnings as errors; its code blocks run in the tests (tests/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The suite on one process more than there are cores, up to 4: each starts its own servers,
# and much of a test's time is spent waiting on them (on 2 cores: 348 s on 3 processes,
# 351 s on 4, 390 s on 2). The 20 slowest tests are listed at the end.
TEST_PROCESSES ?= $(shell $(PYTHON) -c 'import os; print(min(4, (os.cpu_count() or 1) + 1))')
test: $(STAMP) lint docs
	$(BIN)/python -m pytest -q --numprocesses=$(TEST_PROCESSES) --durations=20

$(BENCH_STAMP): $(STAMP) benchmarks/requirements.txt
	$(BIN)/python -m pip install --quiet -r benchmarks/requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps $(PEERS)
	touch $(BENCH_STAMP)

# The peer benchmark (not part of `make test`): by default about 30 minutes on 2 cores, every
# system at 0 and 2 workers on the embedded SeaweedFS, directly and through the network shaper's
# s3-same-region profile, with the target table of each; BENCH_ARGS='' gives everything (about
# 2 hours: also localbucket, the s3-cross-region profile, 4 workers and remote_loader's scaling).
BENCH_ARGS ?= --servers seaweedfs --profiles loopback s3-same-region --workers 0 2 --no-scaling
bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/suite/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache *.egg-info site
