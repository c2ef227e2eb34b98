# The two commands of the README: `make demo` (main job on embedded defaults) and `make test`.
# Both create or update the project's virtual environment in .venv/ by themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# Headless Chromium drives the MLflow UI in the end-to-end test (Debian's package; Playwright downloads nothing).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is missing: run 'sudo apt-get install chromium' (the MLflow UI test needs it)" >&2; exit 1; fi; }

demo: $(STAMP)
	$(BIN)/compat demo

# Two pytest-xdist workers by default: much of the suite waits on servers, Ray start-up and subprocesses, so two
# workers keep a 2-core machine busy (measured on one: 13.4 minutes against 18.7 serial). Each worker has its own
# session servers and temp dirs; a file's tests stay in one worker (its module fixtures start once).
# `make test TEST_WORKERS=0` runs the suite serially in one process.
TEST_WORKERS ?= 2

test: system-deps $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) runs .pytest_cache
