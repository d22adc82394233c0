"""SIGKILL a real `vlmprep build` at random points, rerun with the same arguments, and require the
finished dataset to be byte-identical to an uninterrupted build; no final-named file is ever partial."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest


def hashes(d: Path) -> dict:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


TOOLS = str(Path(__file__).resolve().parents[3] / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")
MODES = {
    "truncate": (
        {"long_traces": "truncate", "min_turn_coverage": 0.0},  # its lost turns accepted
        ["--long-traces", "truncate", "--min-turn-coverage", "0"],
    ),
    # Split records: several samples per record, a shard may close inside a record.
    "split": (
        {"long_traces": "split", "keep_images": 2, "seq_len": 768, "chat_template": TOOLS},
        ["--long-traces", "split", "--keep-images", "last:2", "--seq-len", "768", "--chat-template", TOOLS],
    ),
}


def build_cmd(inp, out, mode="truncate"):
    return [
        sys.executable,
        "-m",
        "vlmprep",
        "build",
        "--in",
        str(inp),
        "--out",
        str(out),
        "--samples-per-shard",
        "2",
        "--seq-len",
        "2048",
        "--no-progress",
        "--max-reject-fraction",
        "1",
        "--min-turn-coverage",
        "0",
        *MODES[mode][1],
    ]


def check_no_partial_final_files(out: Path) -> None:
    for p in out.glob("shard-*.tar"):
        with tarfile.open(p) as tf:  # a complete tar reads to its end-of-archive blocks
            names = tf.getnames()
        assert names and names[-1].endswith(".json"), f"{p.name} is incomplete"
    if (out / "manifest.json").exists():
        manifest = json.loads((out / "manifest.json").read_text())
        for s in manifest["shards"]:
            assert hashlib.sha256((out / s["name"]).read_bytes()).hexdigest() == s["sha256"]
    if (out / "tasks/task-00000.journal.json").exists():
        json.loads((out / "tasks/task-00000.journal.json").read_text())
    if (out / "rejects.jsonl").exists():
        for line in (out / "rejects.jsonl").read_text().splitlines():
            json.loads(line)


@pytest.fixture(scope="module")
def kill_input(tmp_path_factory):
    from scripts.demo_traces import write_traces

    d = tmp_path_factory.mktemp("kill")
    p = d / "traces.jsonl.zst"
    write_traces(
        p,
        n=40,
        seed=5,
        min_images=1,
        max_images=4,
        width=480,
        height=300,
        overlong_fraction=0.1,
        text_only_fraction=0.1,
    )
    # A bad line in the middle: the rejects file must also come out identical after resumes.
    import zstandard

    lines = zstandard.ZstdDecompressor().decompress(p.read_bytes(), max_output_size=1 << 30).splitlines(keepends=True)
    lines.insert(17, b"{broken json\n")
    p.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines)))
    return p


def _forked_build(inp, out, mode="truncate"):
    """Run build() in a child forked from a clean forkserver: the same code path as the CLI, without paying
    interpreter start-up per kill. A plain fork of this (threaded) pytest process can deadlock in the child."""
    import multiprocessing as mp

    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vlmprep.builder.pipeline"])
    cfg = BuildConfig(
        inputs=(str(inp),),
        out=str(out),
        samples_per_shard=2,
        progress=False,
        max_reject_fraction=1.0,
        **{"seq_len": 2048, "min_turn_coverage": 0.0, **MODES[mode][0]},
    )
    proc = ctx.Process(target=build, args=(cfg,))
    proc.start()
    return proc


@pytest.mark.slow  # ~2 min: a reference build, a timing build, then killed builds (test_resume_keeps_completed_shards
@pytest.mark.parametrize("n_kills,mode", [(10, "truncate"), (6, "split")])  # kills and resumes in make test)
def test_sigkill_at_random_points_then_resume_is_byte_identical(n_kills, mode, kill_input, tmp_path, qwen2vl_processor):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # fork safety for the tokenizers thread pool
    ref = tmp_path / "ref"
    subprocess.run(build_cmd(kill_input, ref, mode), check=True, capture_output=True, env=os.environ.copy())
    ref_hashes = hashes(ref)
    assert any(k.startswith("shard-") for k in ref_hashes) and "rejects.jsonl" in ref_hashes

    t0 = time.monotonic()
    proc = _forked_build(kill_input, tmp_path / "timing", mode)
    proc.join(300)
    full = time.monotonic() - t0
    assert proc.exitcode == 0

    out = tmp_path / "killed"
    rng = random.Random(1234)
    kills = 0
    while kills < n_kills:
        proc = _forked_build(kill_input, out, mode)
        proc.join(rng.uniform(0.05, 1.0) * full)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            kills += 1
        check_no_partial_final_files(out)
    # The final, uninterrupted rerun goes through the real CLI.
    subprocess.run(build_cmd(kill_input, out, mode), check=True, capture_output=True, env=os.environ.copy())
    assert hashes(out) == ref_hashes
    if mode == "split":
        assert json.loads((out / "manifest.json").read_text())["totals"]["split_samples"] > 0


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_resume_keeps_completed_shards(kill_input, tmp_path, qwen2vl_processor):
    """A journal that matches is honoured: completed shards are not rewritten (their inode survives)."""
    out = tmp_path / "o"
    proc = subprocess.Popen(build_cmd(kill_input, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(out.glob("shard-*.tar"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    journal = json.loads((out / "tasks/task-00000.journal.json").read_text())
    done = [s["name"] for s in journal["shards"]]
    assert done, "the journal records completed shards"
    inodes = {n: (out / n).stat().st_ino for n in done}
    subprocess.run(build_cmd(kill_input, out), check=True, capture_output=True)
    assert {n: (out / n).stat().st_ino for n in done} == inodes
    assert not (out / "tasks/task-00000.journal.json").exists()
    # Changed arguments invalidate the journal: a different seq-len starts over.
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in manifest["shards"]][: len(done)] == done
    # the input file's share of the totals survived the resume with them (the journal carries it)
    assert manifest["inputs"][0]["totals"] == {k: v for k, v in manifest["totals"].items() if v}
