# Two commands do everything: `make train` (train on the embedded default) and `make test` (the whole
# suite, what CI runs; the 20 slowest tests are printed at the end). `make test-quick` is the subset
# for editing loops (tests not marked slow; under 3 minutes on 2 cores).
# A local virtual environment (.venv) is created on first use, with $(TORCH) from the configured pip index.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
# pytest-xdist workers: each multi-process test starts 2-8 processes of its own, so more would oversubscribe
JOBS   ?= 2

.PHONY: train test test-quick durations install clean bytecode

$(BIN)/meshlm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/meshlm

train: $(BIN)/meshlm
	$(BIN)/meshlm pretrain

# the suite starts hundreds of Python processes: with PYTHONDONTWRITEBYTECODE set (as on some CI hosts)
# each would compile meshlm's sources again (~0.5 s of CPU a process); written once here, they are read
bytecode: $(BIN)/meshlm
	$(BIN)/python -m compileall -q -j 0 src tests

test: bytecode
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --durations=20 tests

test-quick: bytecode
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --durations=10 -m "not slow" tests

# re-measure tests/durations.json, the weights that start the longest tests first on every xdist worker
durations: bytecode
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --write-durations tests/durations.json tests

clean:
	rm -rf $(VENV) runs
