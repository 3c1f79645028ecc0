# Two commands for a fresh machine: `make serve` and `make test`.
# Both install into .venv first, from the lock of this machine's platform
# (scripts/install: requirements-cpu.lock without an NVIDIA driver, else requirements-cuda.lock).
# `make lock` refreshes the locks after a dependency changed in pyproject.toml.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install serve test bench lock clean

$(VENV)/.installed: pyproject.toml scripts/install requirements-cpu.lock requirements-cuda.lock
	VENV=$(VENV) sh scripts/install
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/rtvideo serve

# The tiers run side by side, a test file per process (pytest-xdist; most of a
# test's time is a server or worker starting, or waiting on one): `-n auto` is
# one process more than the cores (tests/conftest.py), at most 4.
# The 15 slowest tests are listed at the end: where to look when the suite nears its 10 minutes.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/rtvideo bench engine --json

lock:
	sh scripts/lock

clean:
	rm -rf $(VENV)
