# `make demo` and `make test` do all set-up on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# the demo's output lives in this checkout (out/ is git-ignored), not in a folder every checkout shares
DEMO_OUT ?= $(CURDIR)/out/demo

.PHONY: demo test venv install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test,inference]'

demo: install
	$(BIN)/refinery prep --input examples/sample_corpus --output $(DEMO_OUT) --dataset sample --num-shards 4
	$(BIN)/refinery verify $(DEMO_OUT)/manifest.json --checksums
	$(BIN)/refinery info $(DEMO_OUT)/manifest.json

test: install-test
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache out/demo
