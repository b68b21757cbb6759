# The two set-up commands of the README: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
PROMPT  ?= reverse: HELLO

.PHONY: setup native demo test clean-native

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Python dependencies (test extras include torch CPU + transformers, the executable reference).
$(VENV)/.deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Our patched llama.cpp bindings; cached outside the repo keyed by sdist + patch + options.
native: $(VENV)/.deps
	$(BIN)/python native/build.py

setup: native

demo: setup
	$(BIN)/dg generate "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest -q

clean-native:
	rm -rf $(HOME)/.cache/dg/native
