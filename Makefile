# The two commands of the README: `make demo` (a local cluster) and `make test`.
# Both bootstrap a fresh machine first (scripts/bootstrap.sh).
VENV := .venv
PY := $(VENV)/bin/python
# pytest-xdist workers: most tests wait on processes, etcd and timers, so two share two
# cores well (each worker has its own etcd; `TEST_WORKERS=0` runs the suite in one process)
TEST_WORKERS ?= 2

.PHONY: bootstrap demo test lint typecheck format protos bench clean

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	@$(PY) scripts/demo.py

test: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

typecheck: bootstrap
	$(VENV)/bin/mypy

format: bootstrap
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

protos: bootstrap
	$(PY) -m protos.generate

bench: bootstrap
	$(VENV)/bin/kvcp-bench --help

clean:
	rm -rf .run .pytest_cache .ruff_cache .mypy_cache
