"""Fixtures of the CLI build tests (test_build_safety.py, test_coverage.py): the session's processor reused, 8
small demo traces, the CLI runner and a dir's state."""

import copy

import pytest
from typer.testing import CliRunner

from tests.vlmprep.conftest import tree_hashes
from vlmprep.cli import app


@pytest.fixture
def fresh_processor(monkeypatch, qwen2vl_processor):
    """Builds reuse a copy of the session's builtin:qwen2-vl (a load is ~15 s on 2 cores); a copy, because a
    --chat-template is set on the processor object itself."""
    for where in (
        "vlmprep.builder.pipeline.load_processor",
        "vlmprep.processors.load.load_processor",
    ):  # build; inspect
        monkeypatch.setattr(where, lambda spec: copy.deepcopy(qwen2vl_processor))


@pytest.fixture(scope="module")
def demo8(tmp_path_factory):
    """`python -m scripts.demo_traces --n 8 --seed 0`, with small screenshots to keep the test fast."""
    from scripts.demo_traces import write_traces

    p = tmp_path_factory.mktemp("demo8") / "traces.jsonl.zst"
    write_traces(p, n=8, seed=0, width=320, height=200, max_images=8)
    return p


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def state(d):
    """Every path under d (empty dirs included) and every file's sha256: "nothing changed" means this is equal."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")), tree_hashes(d)
