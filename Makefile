# gkbuild: two entry points for a fresh machine, `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned: on these machines 2.13.0 is the CPU build on local disk; an
# unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: install demo test test-fast docs browser clean

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
test: $(STAMP) browser
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

# The documentation site from docs/ into site/; strict: a broken link, anchor or reference fails.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# tests/test_docs.py renders the site in Debian's headless Chromium. Installed here where apt-get can
# (root on Debian/Ubuntu); elsewhere the test skips and says Chromium is missing.
browser:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium-headless-shell >/dev/null || \
		echo "make: apt-get could not install chromium-headless-shell: tests/test_docs.py's render check will skip"; \
	else echo "make: no Chromium and no root apt-get: tests/test_docs.py's render check will skip"; fi

clean:
	rm -rf artifacts/* $(VENV) .pytest_cache .hypothesis site
	touch artifacts/.gitkeep
