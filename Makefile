PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false

.PHONY: setup test test-fast bench run clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) bench/engine_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
