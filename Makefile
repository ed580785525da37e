# All set-up happens here: a fresh clone needs only `make serve` or `make test`.
# `make serve` installs what serving needs; `make test` adds the test extras ([dev], [ray]).
# ARGS goes to the command: make serve ARGS="--port 9000", make test ARGS="tests/core -k pool".
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=

.PHONY: install test serve sim figures clean

$(SERVE_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build first (lies on disk here); the range in pyproject then installs nothing more.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $(SERVE_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(TEST_STAMP)

install: $(SERVE_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider $(if $(ARGS),$(ARGS),tests)

serve: $(SERVE_STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

sim: $(SERVE_STAMP)
	$(VENV)/bin/pagedserve sim $(if $(ARGS),$(ARGS),--workload sharegpt-like --allocator paged --block-size 16)

# The paper's memory figures (docs/paper-results.md): sim sweeps and the CPU sharing run, minutes.
figures: $(TEST_STAMP)
	$(PY) benchmarks/paper/paper_figures.py all --jobs 2

clean:
	rm -rf $(VENV) build *.egg-info
