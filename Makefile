# make test: build .venv (once per change to pyproject.toml or this file), then run the suite.
# make demo: the same .venv, then train a small GPT under torchrun (see examples/train_gpt.py).
# make bench: the same .venv plus the `bench` extra (DeepSpeed), then benchmarks/compare.py.
# make gpu-check: on a GPU machine, the CUDA tier and the GPU benchmark in 8 minutes (below).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp

# NOTE: the exact pin matters: an unpinned torch resolves to a multi-GB CUDA build. Where no local
# CPU wheel is on pip's path, add TORCH_PIP_FLAGS='--index-url https://download.pytorch.org/whl/cpu'.
TORCH := torch==2.13.0
TORCH_PIP_FLAGS ?=

# The demo's ranks; extra flags for it go in DEMO_ARGS, e.g. make demo DEMO_ARGS='--steps 100'.
NPROC ?= 2
DEMO_ARGS ?=
# Flags for compare.py, e.g. make bench BENCH_ARGS='--rounds 1 --precision bf16'.
BENCH_ARGS ?=
BENCH_STAMP := $(VENV)/.bench-stamp

export OMP_NUM_THREADS := 1

# make gpu-check: its environment takes torch from a Python whose torch is a CUDA build
# (GPU_PYTHON, else the first of .venv/bin/python and python3 whose torch sees a GPU), since a
# GPU machine may reach no network and $(TORCH) is a CPU build; GPU_WHEELS names a folder of
# wheels for what else it lacks. See benchmarks/gpu_env.py and docs/tests.md.
GPU_VENV := .venv-gpu
GPU_PYTHON ?=
GPU_WHEELS ?=
# Flags for the driver, e.g. make gpu-check GPU_CHECK_ARGS='--budget-s 300'.
GPU_CHECK_ARGS ?=

.PHONY: test demo bench gpu-check

# Lint, then the tiers: in-process tests (threads as ranks) and the peers tier (behaviours of
# FSDP2's and DeepSpeed's suites, each test naming its stages) on three workers at ZeRO stage 3;
# the in-process tests again at stages 1 and 2, in one session (leaving out stage 3's own
# lifetime tests); then the torchrun runs and the fault cases, in one session on three workers,
# collected from tests/e2e, which holds every such test (tests/test_suite.py): 3 s a worker
# instead of 12.
# Each session pays for its workers' imports and collection once, and one session's slow tail
# no longer waits alone: the machine's two cores stay busy to the end. Any failure fails.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not process and not faults" -n 3
	$(BIN)/pytest -m "not process and not faults and not peers and not stage3" --stage 1 --stage 2 -q -n 3
	$(BIN)/pytest tests/e2e -m "process or faults" -n 3

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_gpt.py $(DEMO_ARGS)

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/compare.py $(BENCH_ARGS)

# Every CUDA check (tests/tiers/test_gpu*.py, tests/e2e/test_gpu*.py) and the GPU benchmark,
# one line per check and a report (benchmarks/gpu_check.py); without a GPU each says SKIPPED.
gpu-check:
	$(PYTHON) benchmarks/gpu_env.py $(GPU_VENV) $(if $(GPU_PYTHON),--python $(GPU_PYTHON)) \
		$(if $(GPU_WHEELS),--wheels $(GPU_WHEELS))
	$(GPU_VENV)/bin/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# One environment for both: the process tier runs the demo, so tests need its extra too.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH_PIP_FLAGS) '$(TORCH)'
	$(BIN)/pip install -e '.[test,demo]'
	touch $@

# The test suite never needs DeepSpeed: it is installed only for the benchmark.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[bench]'
	touch $@
