# sm120patch: `make demo` (install + a real demo session), `make test`, `make check` (the fast tests),
# `make manifests`, `make bench`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install demo test check matrix manifests check-manifests bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# A sandbox venv with the real flashinfer-python 0.6.4 and sglang 0.5.9 wheels (no
# dependencies), then status -> apply -> status -> revert -> status.
demo: install
	PATH="$(abspath $(BIN)):$$PATH" bash demo/run.sh

test: install
	$(BIN)/python -m pytest -n auto

# The tests that need no real wheel, no torch, no download: the pipeline on a synthetic
# distribution, the CLI, parsers, rewriters (under a minute, on every core).
check: install
	$(BIN)/python -m pytest -m "not wheels and not waits" -n auto

# Every pinned release of every distribution, from its real wheel (CI's `make test` takes one vLLM
# release per file layout: their wheels are ~400 MB each; this downloads all 34, ~13 GB).
matrix: install
	SM120PATCH_FULL_MATRIX=1 $(BIN)/python -m pytest tests/test_matrix.py

# Rebuild vendor-manifests/ from the real wheels (downloaded into ~/.cache/sm120patch/wheels).
manifests: install
	$(BIN)/sm120patch manifest build

check-manifests: install
	$(BIN)/sm120patch manifest build --check

bench: install
	$(BIN)/python benchmarks/status_vs_pip_show.py

clean:
	rm -rf $(VENV) .demo
