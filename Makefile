# One entry point for set-up, demo, tests and benchmarks. Everything installs into .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_N ?= 64
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install demo lint test test-all test-gpu bench bench-peers clean

# A download cut off mid-wheel (seen on CI: ray's 79 MB wheel, stuck at 30.7 MB through pip's own resumes) must not
# fail the install: pip retries and resumes, and the whole step is tried again after a pause. Set as environment
# variables, which the venv's first pip (23.x, no --resume-retries) ignores where it lacks the option.
define pip_retry
for i in 1 2 3 4; do PIP_RETRIES=10 PIP_RESUME_RETRIES=20 PIP_TIMEOUT=60 $(PY) -m pip install -q $(1) && break; \
  [ $$i = 4 ] && exit 1; echo "pip install failed (try $$i of 4); again in $$((i * 30)) s" >&2; sleep $$((i * 30)); done
endef

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call pip_retry,--upgrade pip)
	# torch first and pinned: pip takes both from local wheels; anything unpinned would pull a CUDA build.
	$(call pip_retry,torch==2.14.1 torchvision==0.29.1)
	$(call pip_retry,-e '.[dev]')
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m scripts.demo_traces --out demo/traces.jsonl.zst --n $(DEMO_N) --seed 0
	$(VENV)/bin/vlmprep build --in demo/traces.jsonl.zst --out demo/shards --processor builtin:qwen2-vl --chat-template qwen2_vl_tools --seq-len 16384 --samples-per-shard 16 --workers 2
	$(VENV)/bin/vlmprep stats demo/shards
	$(VENV)/bin/vlmprep inspect demo/shards --limit 1
	$(VENV)/bin/vlmprep verify demo/shards
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 -m trainer --data demo/shards --out demo/run --tiny-random qwen2-vl --max-steps 4 --num-workers 1 --no-progress --no-resume

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Files spread over TEST_WORKERS processes (pytest-xdist; whole files, so module fixtures are built once);
# TEST_WORKERS=0 runs in this process, e.g. for pdb.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: $(STAMP)
	$(call pip_retry,-e '.[bench]')
	$(PY) -m benchmarks.run $(BENCH_ARGS)

# vlmprep beside LLaMA-Factory's and ms-swift's preprocessing on the same records (docs/performance.md). Each peer
# gets its own venv under bench-out/peers/ (the project's torch hard-linked in, the peer's pinned release from PyPI:
# minutes and ~2 GB on the first run). BENCH_ARGS=--end-to-end adds 3 epochs of each tool's train-time data path.
# Not in CI, `make test` or `make bench`.
bench-peers: $(STAMP)
	$(PY) -m benchmarks.peers $(BENCH_ARGS)

clean:
	rm -rf demo .pytest_cache
