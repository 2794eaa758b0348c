# One-command set-up: every target below creates .venv and installs what it needs first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
RFSDP := $(VENV)/bin/rfsdp
DEMO := work/demo

.PHONY: setup test demo lint bench clean

setup: $(VENV)/.installed

# torch is pinned to 2.13.0: on a CPU machine pip takes the CPU build (a bare `torch` could
# pull a multi-GB CUDA build); on a GPU machine the same pin resolves to the CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: setup
	$(PY) -m pytest -q -ra

demo: setup
	rm -rf $(DEMO)
	$(RFSDP) prepare-data --out $(DEMO)/data
	@echo "== train 60 steps on 2 CPU workers, stopping after step 30 (an exception at step 15 is recovered in-process)"
	$(RFSDP) train --data $(DEMO)/data --run-dir $(DEMO)/run --steps 60 --stop-at-step 30 --fault exception@15:1
	@echo "== the same command without --stop-at-step resumes from the step-30 checkpoint"
	$(RFSDP) train --data $(DEMO)/data --run-dir $(DEMO)/run --steps 60 --fault exception@15:1

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf work .pytest_cache
