# Two commands on a fresh machine: `make run` (main example end to end) and `make test` (the suite).
# Everything is installed into .venv from this repository's own files.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
NPROC ?= 2
CONFIG ?= examples/configs/bmuf.yaml

.PHONY: setup run test bench bench-gba clean

setup: $(STAMP)

# torchrec goes in last with --no-deps: its declared fbgemm-gpu (CUDA) would overwrite fbgemm-gpu-cpu.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[test]"
	$(PIP) install --quiet --no-deps torchrec==1.8.0
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_dlrm.py --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/bench_sync.py

# GBA vs sync all-reduce vs plain async PS, 4 trainers + 1 PS, one trainer 3x slow
bench-gba: $(STAMP)
	$(PY) benchmarks/bench_gba.py --compute simulated
	$(PY) benchmarks/bench_gba.py --compute real --global-samples 2000000

clean:
	rm -rf $(VENV) .pytest_cache
