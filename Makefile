# fedrelay: `make demo` runs the main job, `make test` the test suite. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Demo knobs: make demo SITES=10 SEED=0 DIRICHLET=0.5 SOURCE=/path/to/idx CHAIN_ARGS="-S 5 -E 2"
SITES ?= 10
SEED ?= 0
DIRICHLET ?= 0.5
CHAIN_ARGS ?= --models-per-site 5 --local-epochs 2 --warmup-epochs 2
# The medical demo: make demo-breast-cancer BC_SITES=3 SEED=0 BC_CHAIN_ARGS="..." (a FedELMY chain of
# the tabular-csv task over three hospitals' tables; prints per-site and global AUROC, sensitivity, specificity)
BC_SITES ?= 3
BC_CHAIN_ARGS ?= --models-per-site 3 --local-epochs 5 --warmup-epochs 5 --lr 0.01 --batch-size 32

.PHONY: setup demo demo-breast-cancer test test-fast docs bench bench-reduced bench-few-shot bench-parallel bench-grid bench-privacy proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "fedrelay needs Python >= 3.11 (set PYTHON=python3.11)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(PY) deploy/local_trial.py --sites $(SITES) --dirichlet $(DIRICHLET) --seed $(SEED) --workdir demo \
		$(if $(SOURCE),--source $(SOURCE)) -- $(CHAIN_ARGS)

demo-breast-cancer: setup
	$(PY) deploy/local_trial.py --dataset breast-cancer --sites $(BC_SITES) --seed $(SEED) \
		--workdir demo-breast-cancer -- --task tabular-csv $(BC_CHAIN_ARGS)

# Three pytest-xdist processes, each taking whole files (a file's module fixtures start their daemons
# once), the system trials first (tests/conftest.py): most of a test's time is waiting on daemons.
TEST_PROCESSES ?= 3
test: setup
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder

# The unit tier alone (no processes; about a minute): tests marked neither integration nor system.
test-fast: setup
	FEDRELAY_TEST_TIER=unit $(PY) -m pytest -q -m "not integration and not system"

# The documentation site (docs/, mkdocs.yml) in site/; warnings are errors. The reference pages
# are generated from the code and the figures from bench/results.json (docs/_hooks/generate.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: setup
	$(PY) -m bench.transfer
	$(PY) -m bench.training
	$(PY) -m bench.chain
	nice -n 15 $(PY) -m bench.accuracy --domain-shift
	nice -n 15 $(PY) -m bench.few_shot

# The accuracy grid at a reduced scale (600 training images per site): about 50 minutes.
bench-reduced: setup
	nice -n 15 $(PY) -m bench.accuracy --seeds 0,1,2,3,4 --dirichlets 0.5,0.1 --max-train-per-site 600 \
		--domain-shift --domain-max-train-per-site 1500 \
		--results bench/reduced-scale/results.json --plots bench/reduced-scale/plots

# Few-shot cycles (paper Table 2): FedELMY and FedSeq after T = 1, 2, 3, 5 rounds, 3 seeds x Dirichlet
# 0.1/0.5, one 5-round chain per cell (estimated 1.5 hours on 2 quiet cores; resumable).
bench-few-shot: setup
	nice -n 15 $(PY) -m bench.few_shot

# Accuracy against communication of the one-shot methods (chains FedELMY/FedSeq, stars FedAvg,
# FedELMY-PFL, MA-Echo, OFASD; local-only/centralized): seeds 0-4 x Dirichlet 0.5/0.1, E = Ew = 5,
# 600 training images per site (the published run; about 1 hour on 2 cores; resumable). Drop
# --max-train-per-site for full data (hours).
bench-parallel: setup
	nice -n 15 $(PY) -m bench.parallel --max-train-per-site 600

# The full-data grid (issue #25): every one-shot method, one recipe (RECIPE=paper|ours), 10 sites,
# Dirichlet 0.5/0.1, seeds 0-4, E = Ew = 5, full data; each cell committed as it lands
# (bench/cells/); rerun to resume, `python -m bench.grid --publish-only` to rebuild the tables.
RECIPE ?= paper
bench-grid: setup
	nice -n 15 $(PY) -m bench.grid --recipe $(RECIPE) --commit-cells

# Privacy-utility of DP-SGD at every site (docs/differential-privacy.md): FedELMY and FedSeq at
# target epsilon 1, 4, 16 and without DP, 3 sites at 300 training images each (resumable).
bench-privacy: setup
	nice -n 15 $(PY) -m bench.privacy

proto: setup
	$(PY) -m fedrelay.protogen

clean:
	rm -rf demo demo-breast-cancer .pytest_cache site
