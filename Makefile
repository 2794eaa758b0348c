# One-command set-up: every target below creates .venv and installs what it needs first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
RFSDP := $(VENV)/bin/rfsdp
DEMO := work/demo

.PHONY: setup check test stress demo compare lint bench clean

setup: $(VENV)/.installed

# torch is pinned to 2.13.0: on a CPU machine pip takes the CPU build (a bare `torch` could
# pull a multi-GB CUDA build); on a GPU machine the same pin resolves to the CUDA build.
# pip's output goes to .venv/setup.log (shown when it fails): the targets' own output stays readable.
$(VENV)/.installed: pyproject.toml
	@echo "== setting up $(VENV) (a few minutes the first time; pip's output: $(VENV)/setup.log)"
	@$(PYTHON) -m venv $(VENV)
	@( $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q torch==2.13.0 \
		&& $(PY) -m pip install -q -e '.[dev]' ) > $(VENV)/setup.log 2>&1 \
		|| { tail -n 40 $(VENV)/setup.log; echo "== set-up failed: $(VENV)/setup.log"; exit 1; }
	@touch $@

# The fast tier, under a minute: import contracts, lint, then tests/unit (unit and contract tests:
# no process beyond pytest). ruff formats the Python sources only, not the docs' Markdown code blocks.
check: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check --exclude '*.md' .
	$(PY) -m pytest -q -ra tests/unit

# Everything (CI): import contracts, then every test tier this machine can run (tests/unit,
# tests/integration, tests/e2e), the 30 slowest listed. Two pytest workers (pytest-xdist), each
# taking whole files: most tests wait on jobs, servers and timeouts part of the time, and a file's
# module fixtures are made once.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile

# The in-flight-save fault stress alone, 20 runs (half of them beside busy loops on every core).
stress: setup
	RFSDP_STRESS_REPEAT=20 $(PY) -m pytest -q -ra -m stress

demo: setup
	rm -rf $(DEMO)
	@echo "== the whole pipeline locally (kfp.local): prepare data -> train 60 steps on 2 CPU workers, rank 1 raises"
	@echo "   at step 15 (in-process restart), rank 0 is SIGKILLed at step 30 (in-job restart) -> validate -> MLflow"
	$(RFSDP) pipeline run-local --root $(DEMO) --set fault=exception@15:1,sigkill@30:0

# A small sweep into one fresh MLflow experiment (default store: work/mlflow/): sync vs async
# checkpointing x no faults vs a fault schedule; then the comparison notebook, executed. The small
# model with a checkpoint every 2 steps: a sync save stalls the loop for about half a step, a share
# worth comparing (at the tiny model it is noise), and the four runs take about 2 minutes.
COMPARE_STAMP := $(shell date +%Y%m%d-%H%M%S)
COMPARE_EXPERIMENT ?= compare-$(COMPARE_STAMP)
COMPARE_DIR = work/compare/$(COMPARE_EXPERIMENT)
COMPARE_FAULT ?= exception@12:1,sigkill@27:0
COMPARE_MODEL ?= small
COMPARE_EVERY ?= 2

define compare_run
	$(RFSDP) train --quiet --data $(COMPARE_DIR)/data --run-dir $(COMPARE_DIR)/$(1) --model $(COMPARE_MODEL) --steps 40 --ckpt-every $(COMPARE_EVERY) --local-ckpt-every 0 $(2)
	$(RFSDP) log-mlflow --run-dir $(COMPARE_DIR)/$(1) --experiment $(COMPARE_EXPERIMENT)
endef

compare: setup
	$(RFSDP) prepare-data --out $(COMPARE_DIR)/data
	$(call compare_run,sync-nofaults,--ckpt-mode sync)
	$(call compare_run,async-nofaults,--ckpt-mode async)
	$(call compare_run,sync-faults,--ckpt-mode sync --fault $(COMPARE_FAULT))
	$(call compare_run,async-faults,--ckpt-mode async --fault $(COMPARE_FAULT))
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m papermill --log-level WARNING notebooks/compare_experiments.ipynb \
		$(COMPARE_DIR)/compare_experiments.ipynb -p experiment $(COMPARE_EXPERIMENT) -p figures_dir $(COMPARE_DIR)
	@echo "== executed notebook: $(COMPARE_DIR)/compare_experiments.ipynb (experiment $(COMPARE_EXPERIMENT))"
	@echo "== MLflow UI: $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/work/mlflow/mlflow.db"

# Every benchmark at full size (tens of minutes on 2 CPU cores): tables on stdout, JSON in bench/results/.
bench: setup
	$(RFSDP) bench all --json bench/results/latest.json

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check --exclude '*.md' .
	$(VENV)/bin/lint-imports

clean:
	rm -rf work .pytest_cache
