"""renderer_from_saved: a worker made ready from the dataset's saved processor dir alone renders byte-identically to
the main process, with --chat-template and --max-pixels carried by the saved copy (the template file is gone); pool
workers are forked ready, with the Renderer their task process loaded."""

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from vlmprep.builder.workers import renderer_from_saved
from vlmprep.config import BuildConfig
from vlmprep.ingest.records import iter_records
from vlmprep.process import Renderer
from vlmprep.processors.load import load_processor, save_processor

TOOLS_TEMPLATE = Path(__file__).parents[3] / "vlmprep" / "templates" / "qwen2_vl_tools.jinja"
MAX_PIXELS = 128 * 28 * 28  # well under the demo images' 480x270, so the budget changes every image's grid


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_worker_renderer_from_saved_dir_is_byte_identical_without_the_template_file(tmp_path):
    from scripts.demo_traces import write_traces

    traces = tmp_path / "traces.jsonl.zst"
    write_traces(
        traces,
        n=4,
        seed=3,
        min_images=1,
        max_images=2,
        width=480,
        height=270,
        overlong_fraction=0.0,
        text_only_fraction=0.0,
    )
    template = tmp_path / "tools.jinja"
    shutil.copy(TOOLS_TEMPLATE, template)
    cfg = BuildConfig(
        inputs=(str(traces),),
        out=str(tmp_path / "out"),
        progress=False,
        seq_len=8192,
        chat_template=str(template),
        max_pixels=MAX_PIXELS,
    )
    main = Renderer(cfg, load_processor("builtin:qwen2-vl"))  # a fresh copy: Renderer sets template and budget on it
    save_processor(main.processor, tmp_path / "processor")
    template.unlink()  # a task or Ray worker elsewhere has only the dataset dir

    worker = renderer_from_saved(cfg, tmp_path / "processor")
    assert worker.processor.chat_template == TOOLS_TEMPLATE.read_text(encoding="utf-8")
    assert worker.processor.image_processor.size.longest_edge == MAX_PIXELS
    n_ok = 0
    for raw in iter_records([traces]):
        expected, got = main.process(raw), worker.process(raw)
        assert got == expected, f"record {raw.position}"
        n_ok += sum(status == "ok" and s.num_images > 0 for status, s in expected[0])
    assert n_ok >= 3, "the check needs rendered samples with images"


def _renderer_and_parent():
    from vlmprep.builder import workers

    return id(workers._RENDERER), getattr(workers._RENDERER, "marked", None), os.getppid(), os.getpid()


def test_pool_workers_are_forked_ready_with_the_loaded_renderer(tmp_path):
    """--workers N: each worker is forked from the process that loaded the Renderer and renders with its copy of it,
    so a worker neither imports nor loads a processor (the 3 s + 8 s a worker used to spend before its first record);
    the output equals one worker's (tests/vlmprep/builder/test_build.py)."""
    from vlmprep.builder.workers import record_workers

    cfg = BuildConfig(inputs=("x.jsonl",), out=str(tmp_path / "out"), progress=False, workers=2)
    renderer = Renderer(cfg, load_processor("builtin:qwen2-vl"))
    renderer.marked = "loaded here"
    with record_workers(cfg, renderer) as pool:
        got = {f.result() for f in [pool.submit(_renderer_and_parent) for _ in range(8)]}
    assert {(r, m, parent) for r, m, parent, _ in got} == {(id(renderer), "loaded here", os.getpid())}
    with record_workers(dataclasses.replace(cfg, workers=1), renderer) as pool:
        assert pool is None  # one worker: records render in this process
