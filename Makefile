# gkbuild: two entry points for a fresh machine, `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned: on these machines 2.13.0 is the CPU build on local disk; an
# unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: install demo test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gkbuild compile recipes/tiny-cpu.yaml
	$(VENV)/bin/gkbuild verify artifacts/tiny-cpu --prompt "The capital of France is" --chat \
		--prompt "Once upon a time" --steps 8 --report artifacts/tiny-cpu-report
	$(VENV)/bin/gkbuild verify artifacts/tiny-cpu --engine compiled --steps 8 -q

# Two workers, a test file each at a time (module fixtures stay in one process): the 2-core CI
# machines run the suite in about 11 minutes instead of 16.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

clean:
	rm -rf artifacts/* $(VENV) .pytest_cache .hypothesis
	touch artifacts/.gitkeep
