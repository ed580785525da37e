# All set-up happens here: a fresh clone needs only `make test` or `make serve`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve sim figures clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build first (lies on disk here); the range in pyproject then installs nothing more.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider tests

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve

sim: $(STAMP)
	$(VENV)/bin/pagedserve sim --workload sharegpt-like --allocator paged --block-size 16

# The paper's memory figures (docs/paper-results.md): sim sweeps and the CPU sharing run, minutes.
figures: $(STAMP)
	$(PY) benchmarks/paper_figures.py all --jobs 2

clean:
	rm -rf $(VENV) build *.egg-info
