# Two commands on a fresh machine: `make run` (main example end to end) and `make test` (the suite).
# Everything is installed into .venv from this repository's own files.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
NPROC ?= 2
CONFIG ?= examples/configs/bmuf.yaml
PRESET ?=

.PHONY: setup run test test-hosts test-newer bench bench-quick bench-quality bench-scaling bench-sync bench-gba bench-2d readme-figure bench-control-plane bench-ps bench-elastic bench-rejoin bench-heal bench-hosts bench-host-faults bench-memory calibrate soak clean

setup: $(STAMP)

# $(call install,VENV,LOCK): VENV holds exactly LOCK's packages (a tested stack, installed --no-deps:
# see the lock's header) and this checkout, editable. The wheel leaves ctrkit/ (the benchmark kit) out,
# so a .pth file puts the checkout itself on the path, for the benchmark scripts and their torchrun ranks.
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet --no-deps -r $(2)
	$(1)/bin/python -m pip install --quiet --no-deps -e .
	$(1)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/shadowgba-checkout.pth', 'w').write(sys.argv[1])" $(CURDIR)
endef

DEV_STACK := requirements/torch-2.13-cpu.txt
NEWER_STACK := requirements/torch-2.14-cpu.txt
NEWER_VENV := .venv-torch2.14

$(STAMP): pyproject.toml Makefile $(DEV_STACK)
	$(call install,$(VENV),$(DEV_STACK))
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) benchmarks/train_dlrm.py --config $(CONFIG) \
		$(if $(PRESET),--preset $(PRESET))

# The checkout's own modules, byte-compiled once before a suite: every process a test starts imports
# them, and where PYTHONDONTWRITEBYTECODE is set (as on the development machines) each would compile
# them anew, about a second of CPU a process.
COMPILE = $(1) -m compileall -q -j 0 shadowgba sync_algos benchmarks tests examples ctrkit

test: $(STAMP)
	$(call COMPILE,$(PY))
	$(PY) -m pytest tests -m "not hosts"

# Every layout across simulated hosts (network namespaces with shaped links, ctrkit/cluster.py), and the
# network faults: needs root, as CI runs; without it this fails, saying why (tests/conftest.py), where a
# plain pytest run skips them.
test-hosts: $(STAMP)
	$(call COMPILE,$(PY))
	$(PY) -m pytest tests -m hosts --require-hosts

# The suite on the other tested stack (torch 2.14, TorchRec 1.9, fbgemm-gpu-cpu 1.9; README, "Supported
# versions") from a fresh virtual environment of its own: not part of `make test`.
test-newer:
	rm -rf $(NEWER_VENV)
	$(call install,$(NEWER_VENV),$(NEWER_STACK))
	$(call COMPILE,$(NEWER_VENV)/bin/python)
	$(NEWER_VENV)/bin/python -m pytest tests

# The benchmark matrix (benchmarks/bench_matrix.py): every algorithm x mode x straggler x dataset x 3 seeds,
# JSON, Markdown and plots under runs/; bench-quick is the < 10 min subset. Plots need the bench extra.
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PIP) install --quiet -e ".[bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_matrix.py --preset full

bench-quick: $(BENCH_STAMP)
	$(PY) benchmarks/bench_matrix.py --preset quick

# Quality near convergence: the shadow algorithms, none, ddp, pma and gba on 6.1M synthetic samples, 3 seeds.
bench-quality: $(BENCH_STAMP)
	$(PY) benchmarks/bench_matrix.py --preset quality

# samples/s vs trainers (1, 2, 4, 8) for none, ddp and the shadow algorithms
bench-scaling: $(BENCH_STAMP)
	$(PY) benchmarks/bench_scaling.py

# GBA vs sync all-reduce vs plain async PS, 4 trainers + 1 PS, one trainer 3x slow
# Loopback, 2 ranks: local training, DDP, torch's PMA and every shadow mode side by side at the small
# and production presets, interleaved (benchmarks/bench_sync.py; runs/bench_sync.json)
bench-sync: $(STAMP)
	$(PY) benchmarks/bench_sync.py

bench-gba: $(STAMP)
	$(PY) benchmarks/bench_gba.py --compute simulated
	$(PY) benchmarks/bench_gba.py --compute real

# The 2D layout (2 replica groups x 2 ranks, one rank 3x slow, and without it), simulated and real compute:
# shadowgba 2D vs TorchRec's 2D recipe, flat DDP and no cross-group sync, then held-out AUC at equal samples
# (benchmarks/bench_2d.py; runs/bench_2d.json)
bench-2d: $(STAMP)
	$(PY) benchmarks/bench_2d.py

# The README's figure (docs/images/gba_straggler.png): GBA and plain async against sync at the production
# preset under a 3x straggler, speed and the AUC curve over 3 seeds (benchmarks/bench_plots.py; needs the
# bench extra). Its JSON takes about 80 min on 2 cores; an existing runs/bench_gba_figure.json is reused.
GBA_FIGURE_RUN := --compute real --presets production --shards 1 --warmup-steps 5 --factor 3 \
	--global-samples 2000000 --curve-every 500000 --algos sync,gba,async --seeds 0,1,2
runs/bench_gba_figure.json: | $(STAMP)
	$(PY) benchmarks/bench_gba.py $(GBA_FIGURE_RUN) --output $@

readme-figure: $(BENCH_STAMP) runs/bench_gba_figure.json
	$(PY) benchmarks/bench_plots.py --bench-gba runs/bench_gba_figure.json --output docs/images/gba_straggler.png

# The control plane at scale (benchmarks/bench_control_plane.py; docs/scaling.md, "The control plane"): one
# store's capacity, ma jobs of 16, 32 and 64 ranks (flat and 2D, one rank killed), and the store's load
# projected to 1,024 and 4,096 ranks; JSON under runs/
bench-control-plane: $(STAMP)
	$(PY) benchmarks/bench_control_plane.py --output runs/bench_control_plane_store.json store --clients 32
	$(PY) benchmarks/bench_control_plane.py --output runs/bench_control_plane_jobs.json jobs --reps 3
	$(PY) benchmarks/bench_control_plane.py project --store runs/bench_control_plane_store.json \
		--jobs runs/bench_control_plane_jobs.json --before-ops-per-peer 9.1

# The parameter server alone: dense ingest per server rank vs push size, shards and pushes in flight,
# and embedding lookups / row pushes (benchmarks/bench_ps.py; runs/bench_ps.json)
bench-ps: $(STAMP)
	$(PY) benchmarks/bench_ps.py --embeddings

# A trainer killed at 30% of a GBA job with PS-hosted tables (4 trainers + 1 server, the elastic layout) and
# restarted 20 s later, against the same job uninterrupted (benchmarks/bench_elastic.py; runs/bench_elastic.json)
bench-elastic: $(STAMP)
	$(PY) benchmarks/bench_elastic.py

# The 2D layout as a torchrun job per replica group (2 x 2 ranks): a rank of group 1 killed at 30% and its
# group restarted 20 s later, and one stopped for good, against the same job uninterrupted, 3 seeds
# (benchmarks/bench_rejoin.py; runs/bench_rejoin.json)
bench-rejoin: $(STAMP)
	$(PY) benchmarks/bench_rejoin.py

# A replica gone NaN and healed under sync.on_nonfinite: skip, against the same job clean, per algorithm
# (benchmarks/bench_heal.py; runs/bench_heal.json)
bench-heal: $(STAMP)
	$(PY) benchmarks/bench_heal.py

# A trainer's resident memory under each runtime, and a dense server's, against the dense size
# (benchmarks/memory_probe.py)
bench-memory: $(STAMP)
	$(PY) benchmarks/memory_probe.py

# The throughput model's inputs measured on this machine (benchmarks/calibrate.py; docs/scaling.md);
# `calibrate.py validate` then checks its predictions against make bench-scaling's results
calibrate: $(STAMP)
	$(PY) benchmarks/calibrate.py measure

# Across hosts (needs root): the flat variants on 2 simulated hosts, links at 1 and 10 Gbit/s, without and
# with a 3x straggler (benchmarks/bench_hosts.py; runs/bench_hosts.json)
bench-hosts: $(STAMP)
	$(PY) benchmarks/bench_hosts.py

# Across hosts (needs root): the network-fault tests of test-hosts, 3 runs each, as one table of verdicts
# and measured figures (benchmarks/bench_host_faults.py; runs/bench_host_faults.json)
bench-host-faults: $(STAMP)
	$(PY) benchmarks/bench_host_faults.py

# Soak (not in `make test`): random configurations as torchrun jobs with faults, restarts and resumes,
# for SOAK_MINUTES; the report goes to runs/soak.json (benchmarks/soak.py).
SOAK_MINUTES ?= 6

soak: $(STAMP)
	$(PY) benchmarks/soak.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) $(NEWER_VENV) .pytest_cache
