# Two commands for a fresh machine: `make serve` and `make test`.
# Both install into .venv first (scripts/install decides the torch build).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml scripts/install
	VENV=$(VENV) sh scripts/install
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/rtvideo serve

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/rtvideo bench engine --json

clean:
	rm -rf $(VENV)
