# The two set-up commands of the README: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
PROMPT  ?= reverse: HELLO

.PHONY: setup native demo test test-fast test-hub-floor test-clients examples clean-native

# dg needs Python >= 3.10 (pyproject.toml); say so before pip does (macOS's own python3 is 3.9)
$(BIN)/python:
	@if ! command -v $(PY) >/dev/null 2>&1; then found="not installed"; \
	elif ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then found="$$($(PY) --version 2>&1)"; fi; \
	if [ -n "$$found" ]; then \
	  echo "dg needs Python 3.10 or newer, and '$(PY)' is $$found." >&2; \
	  echo "Install a newer Python (on a Mac: 'brew install python@3.12', or python.org's installer)," >&2; \
	  echo "then run: make $(or $(MAKECMDGOALS),demo) PY=python3.12" >&2; exit 1; fi
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# dg's own dependencies: all `make demo` needs.
$(VENV)/.deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# The test extras add the executable reference (torch CPU + transformers) and pytest.
$(VENV)/.test-deps: pyproject.toml $(VENV)/.deps
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# examples/ draw figures with matplotlib.
$(VENV)/.examples-deps: pyproject.toml $(VENV)/.deps
	$(BIN)/pip install -q -e '.[examples]'
	touch $@

# Our patched llama.cpp bindings; cached outside the repo keyed by sdist + patch + options
# (a cold build is ~4 min on 2 cores, a cached one a few seconds).
native: $(VENV)/.deps
	$(BIN)/python native/build.py

setup: native

# the prompt as typed: single-quoted for the shell, $ not expanded by make ($(value ...))
demo: setup
	$(BIN)/dg generate '$(subst ','\'',$(value PROMPT))' --pace 0.3

# The experiments A-D on the demo model: tables and figures under examples/out/.
examples: setup $(VENV)/.examples-deps
	$(BIN)/python examples/exp_a_untrained.py
	$(BIN)/python examples/exp_b_commit_waves.py --model demo
	$(BIN)/python examples/exp_c_speed_model.py --model demo --repeat 3
	$(BIN)/python examples/exp_d_batch_sweep.py --model demo

# The Node openai SDK for dg serve's client test (tests/test_serve_clients.py; 20 MB). Where npm is
# missing nothing is installed and that test says it is skipped.
NODE_CLIENTS = .clients-node
NODE_CLIENT  = $(NODE_CLIENTS)/.installed
$(NODE_CLIENT):
	mkdir -p $(NODE_CLIENTS)
	if ! command -v npm >/dev/null 2>&1; then echo "npm not found: the Node client test will be skipped"; \
	elif npm install --silent --no-audit --no-fund --prefix $(NODE_CLIENTS) openai@6.49.0; then touch $@; \
	else echo "warning: npm could not install the openai SDK: the Node client test will be skipped"; fi

test: setup $(VENV)/.test-deps test-hub-floor $(NODE_CLIENT)
	$(BIN)/python -m pytest -q

# The edit loop: every test but the kinds that start processes, drive a terminal, import torch or run
# long (the markers in pyproject.toml); a couple of minutes on 2 cores. `make test` (and CI) runs all.
FAST_TESTS ?= not (subprocess or pty or reference or slow)
test-fast: setup $(VENV)/.test-deps
	$(BIN)/python -m pytest -q -m "$(FAST_TESTS)"

# langchain-openai and litellm against dg serve, in a venv of their own (~430 MB, so not in `make test`).
CLIENTS_VENV = .venv-clients
test-clients: setup $(VENV)/.test-deps $(NODE_CLIENT)
	test -x $(CLIENTS_VENV)/bin/python || $(PY) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q "langchain-openai==1.7.4" "litellm==1.110.2"
	$(BIN)/python -m pytest -q tests/test_serve_clients.py

# dg pull's tests against the oldest huggingface-hub pyproject.toml allows, in a venv of its own.
HUB_FLOOR  = $(shell sed -n 's/.*"huggingface-hub>=\([0-9.]*\).*/\1/p' pyproject.toml)
FLOOR_VENV = .venv-hub-floor
test-hub-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install -q -e . pytest "huggingface-hub==$(HUB_FLOOR)"
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_hub.py tests/test_hub_security.py \
		tests/test_hub_files.py tests/test_registry_hub.py tests/test_cli.py tests/test_cli_models.py \
		-k "hub or pull or list or security or info"

clean-native:
	rm -rf $(HOME)/.cache/dg/native
