# The README's two set-up commands: `make bench` and `make test`. Each creates .venv and installs
# tritonkit on first use. On a machine that already has torch and triton (a GPU image), the venv
# sees them (--system-site-packages) and nothing replaces them; elsewhere the CPU build of torch
# and the Triton version the GPU image runs are installed, so CI tests the same compiler. The check
# asks the new venv, not $(PYTHON): a venv made from inside another venv sees the base interpreter's
# packages, not the outer venv's, so torch found by an activated venv's python may not be there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_CPU := torch==2.13.0
TRITON_PIN := triton==3.6.0

.PHONY: bench test test-gpu lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if $(PYTHON) -m venv --system-site-packages $(VENV) && $(PY) -c "import torch, triton" >/dev/null 2>&1; then \
		echo "setup: torch and triton are installed here; using them"; \
		$(PY) -m pip install -q --no-deps --no-build-isolation -e . ; \
	else \
		echo "setup: installing $(TORCH_CPU) (CPU build), $(TRITON_PIN) and tritonkit into $(VENV)"; \
		rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) && \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q $(TORCH_CPU) $(TRITON_PIN) && \
		$(PY) -m pip install -q -e '.[dev]' ; \
	fi
	@touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/tritonkit bench

# Two pytest workers where pytest-xdist is installed (the dev extras): the interpreter runs one test
# on one core: on a CI machine's two the suite takes under 5 minutes (224 s at 992d2ed). Work
# stealing: a worker that runs out takes tests queued on the other, so the run ends together.
test: $(STAMP)
	@start=$$(date +%s); \
	workers=$$($(PY) -c "import xdist" 2>/dev/null && echo "-n 2 --dist worksteal"); \
	$(PY) -m pytest -q $$workers; status=$$?; \
	echo "test suite took $$(( $$(date +%s) - start )) s"; \
	exit $$status

# Eight workers where pytest-xdist is installed: the gpu tests are mostly compiles (CPU-bound), and
# one GPU holds eight processes' tensors; the tests marked hbm (gigabytes each) share one worker
# (--dist loadgroup: under eight workers side by side they overran the H200's memory).
# TRITONKIT_TEST_FAILURES=FILE writes each failure to FILE as it happens (tests/conftest.py).
test-gpu: $(STAMP)
	@workers=$$($(PY) -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadgroup"); \
	$(PY) -m pytest -q -m gpu $$workers

# What CI holds the tree to besides the tests: ruff's lint rules, and the formatting `ruff format` gives
# (the 800-line cap is on formatted files: tests/test_house.py checks it).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV)
