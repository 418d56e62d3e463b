# `make demo` and `make test` do all set-up on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# the demo's output lives in this checkout (out/ is git-ignored), not in a folder every checkout shares
DEMO_OUT ?= $(CURDIR)/out/demo
.PHONY: demo test test-fast lint venv install install-test flink-cache prism-cache flink-demo report-example clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

# pip runs again only when setup.py changed since its last install here (the stamps in $(VENV) say when)
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,inference]'
	touch $@ $(VENV)/.installed  # the package itself is installed too

demo: install
	$(BIN)/refinery prep --input examples/sample_corpus --output $(DEMO_OUT) --dataset sample --num-shards 4
	$(BIN)/refinery verify $(DEMO_OUT)/manifest.json --checksums
	$(BIN)/refinery info $(DEMO_OUT)/manifest.json

# examples/decon_report.html: refinery decon's report page on the bundled data, written again
# (tests/test_decon_report.py checks that the checked-in page is not stale)
report-example: install
	$(BIN)/python examples/make_decon_report.py examples/decon_report.html

# Beam's Flink job server jar and a Flink distribution, fetched once into .cache/flink (git-ignored),
# where --runner flink and the Flink tests look. Without Java or Maven this says so and goes on: the
# Flink tests then skip with one reason (.ci/run sets REFINERY_REQUIRE_FLINK=1: they fail instead).
flink-cache: install
	@if ! command -v java >/dev/null; then echo "Flink tests skipped: no Java (OpenJDK 11+ runs Beam's Flink job server)"; \
	elif ! command -v mvn >/dev/null; then echo "Flink tests skipped: no Maven (mvn fetches Beam's Flink job server)"; \
	else $(BIN)/python -m refinery.runners.flink_local fetch || echo "WARNING: Flink could not be fetched; its tests skip"; fi

# Beam's Prism runner (a Go binary) for the installed Beam, built once into .cache/prism (git-ignored)
# with `go install` from the Go module proxy, where --runner prism and the Prism tests look; a cached
# binary of that Beam version is reused. Without Go this says so and goes on: the Prism tests then skip
# with one reason (.ci/run sets REFINERY_REQUIRE_PRISM=1: they fail instead).
prism-cache: install
	@if ! command -v go >/dev/null; then echo "Prism tests skipped: no Go (go builds Beam's Prism runner)"; \
	else $(BIN)/python -m refinery.runners.prism_local build || echo "WARNING: Prism could not be built; its tests skip"; fi

# ruff's checks (ruff.toml): pyflakes, pycodestyle, import order, bugbear; then mypy's (mypy.ini): strict on
# every module of the project, tests and bench included. The package `refinery` is this
# checkout (setup.py's package_dir): mypy and pyright find it through the committed link .typecheck/refinery.
# MYPY_PACKAGES: the whole checkout (tests/ and bench/ included: they are under the package root), clean
MYPY_PACKAGES ?= -p refinery
lint: install-test
	$(BIN)/ruff check .
	$(BIN)/mypy $(MYPY_PACKAGES)

# the suite runs in TEST_WORKERS processes (pytest-xdist), a test module to each at a time (--dist loadfile:
# a module's shared fixtures, a Flink cluster or a tiny model's job, are built once); TEST_WORKERS=0 runs it
# in this process
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile
test: install-test flink-cache prism-cache lint
	$(PYTEST) tests

# the suite without its slowest modules (tests/conftest.py SLOW_MODULES: clusters, kill loops, the
# README run): for iterating; CI runs `make test`
test-fast: install-test
	$(PYTEST) -m "not slow" tests

# a local Flink session cluster from the PyPI wheels, the demo on it, its web UI's address; then stopped
flink-demo: install flink-cache
	$(BIN)/python -m refinery.runners.flink_local demo --input examples/sample_corpus --output $(CURDIR)/out/flink-demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache out/demo out/flink-demo
