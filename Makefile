# One entry point for set-up, demo, tests and benchmarks. Everything installs into .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_N ?= 64
PYTEST_ARGS ?=

.PHONY: install demo test test-all test-gpu bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: pip takes both from local wheels; anything unpinned would pull a CUDA build.
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m vlmprep.demo --out demo/traces.jsonl.zst --n $(DEMO_N) --seed 0
	$(VENV)/bin/vlmprep build --in demo/traces.jsonl.zst --out demo/shards --processor builtin:qwen2-vl --seq-len 16384 --workers 2

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf demo .pytest_cache
