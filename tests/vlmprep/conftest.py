"""Fixtures for planned builds (test_tasks.py, test_ray.py): one small trace file with a bad line and an id repeated
across tasks, its one-task build, and its 3-task build by the local pool (the reference every executor must equal)."""
import hashlib
from pathlib import Path

import pytest

from vlmprep.config import BuildConfig
from vlmprep.build.pipeline import build

ROOT = Path(__file__).resolve().parents[2]
TOOLS = str(ROOT / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")
OPTS = dict(seq_len=2048, samples_per_shard=2, chat_template=TOOLS, max_reject_fraction=1.0)  # bad lines on purpose


def planned_cfg(inp, out, **kw):
    return BuildConfig(inputs=(str(inp),), out=str(out), progress=False, **{**OPTS, **kw})


def tree_hashes(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def task_traces(tmp_path_factory):
    from scripts.demo_traces import write_traces

    import zstandard

    d = tmp_path_factory.mktemp("tasks")
    write_traces(d / "t.jsonl.zst", n=14, seed=3, min_images=1, max_images=3, width=320, height=200,
                 overlong_fraction=0.1, text_only_fraction=0.1)
    raw = zstandard.ZstdDecompressor().decompress((d / "t.jsonl.zst").read_bytes(), max_output_size=1 << 30)
    lines = raw.splitlines(keepends=True)
    p = d / "traces.jsonl"
    lines.insert(5, b"{broken json\n")  # a reject in task 0 or 1: rejects.jsonl must merge in plan order
    lines.append(lines[9])  # the same id again in the last task: only merge can see it
    p.write_bytes(b"".join(lines))
    return p


@pytest.fixture(scope="session")
def single(task_traces, tmp_path_factory, qwen2vl_processor):
    out = tmp_path_factory.mktemp("single") / "ds"
    build(planned_cfg(task_traces, out))
    return out


@pytest.fixture(scope="session")
def local3(task_traces, tmp_path_factory, qwen2vl_processor):
    out = tmp_path_factory.mktemp("local3") / "ds"
    res = build(planned_cfg(task_traces, out, tasks=3, workers=2))
    return out, res


