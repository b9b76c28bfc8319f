# Two commands do everything: `make train` (train on the embedded default) and `make test`.
# A local virtual environment (.venv) is created on first use, with $(TORCH) from the configured pip index.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: train test install clean

$(BIN)/meshlm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/meshlm

train: $(BIN)/meshlm
	$(BIN)/meshlm pretrain

test: $(BIN)/meshlm
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs
