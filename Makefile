# Two commands: `make demo` runs the main job, `make test` runs the tests. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gyre-installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,real]'
	touch $(STAMP)

.PHONY: install demo test bench
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gyre-sim compare --out out/compare

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_sim.py
