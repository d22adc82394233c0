# One entry point for set-up, demo, tests and benchmarks. Everything installs into .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_N ?= 64
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install demo lint test test-all test-gpu bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: pip takes both from local wheels; anything unpinned would pull a CUDA build.
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m scripts.demo_traces --out demo/traces.jsonl.zst --n $(DEMO_N) --seed 0
	$(VENV)/bin/vlmprep build --in demo/traces.jsonl.zst --out demo/shards --processor builtin:qwen2-vl --chat-template qwen2_vl_tools --seq-len 16384 --samples-per-shard 16 --workers 2
	$(VENV)/bin/vlmprep stats demo/shards
	$(VENV)/bin/vlmprep inspect demo/shards --limit 1
	$(VENV)/bin/vlmprep verify demo/shards
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 -m trainer --data demo/shards --out demo/run --tiny-random qwen2-vl --max-steps 4 --num-workers 1 --no-progress

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf demo .pytest_cache
