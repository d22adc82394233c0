"""A newcomer's build is safe by default: too many rejects fail loudly (with the fix), an --out holding another
build or unrelated files is refused unchanged, a failed start leaves no dir, missing paths are one line, and the help
lists what there is to choose."""

import json
import re

import pytest

from tests.vlmprep.builder.conftest import invoke, state
from tests.vlmprep.conftest import a_manifest, tree_hashes
from vlmprep.builder.pipeline import RejectsError, check_rejects
from vlmprep.processors.load import TEMPLATES_DIR, resolve_chat_template
from vlmprep.shards.manifest import Manifest, ShardEntry
from vlmprep.shards.summary import format_build_summary, rejected_records

# docs/build.md: the recommended setting for browser-agent traces, with the tool-aware template.
AGENT = [
    "--seq-len",
    "16384",
    "--long-traces",
    "split",
    "--keep-images",
    "last:3",
    "--dropped-image-text",
    "[earlier screenshot]",
    "--max-pixels",
    "1003520",
]


def text_records(path, n=3):
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.mark.slow  # make test-all; long in make test (issue 33's 8-minute budget)
def test_readme_agent_example_trains_every_turn_and_without_the_template_fails_with_the_fix(
    demo8, tmp_path, fresh_processor
):
    out = tmp_path / "agent"
    res = invoke("build", "--in", demo8, "--out", out, "--no-progress", *AGENT, "--chat-template", "qwen2_vl_tools")
    assert res.exit_code == 0, res.output
    turns = json.loads((out / "manifest.json").read_text())["turns"]
    assert turns["trained_assistant_turns"] == turns["input_assistant_turns"] > 8 and turns["coverage"] == 1.0
    assert "rejected          0 of 8 records (0.0%)" in res.stdout

    # Without the tool-aware template (the README's examples before): most records rejected -> exit 1, with the fix.
    bare = tmp_path / "bare"
    res = invoke("build", "--in", demo8, "--out", bare, "--no-progress", *AGENT)
    assert res.exit_code == 1
    m = json.loads((bare / "manifest.json").read_text())  # everything is still written
    n = m["rejects"]["tool_calls_not_rendered"]
    assert n > 4 and (bare / "rejects.jsonl").read_text().count("\n") == n
    assert f"rejected          {n} of 8 records ({n / 8:.1%}) -> rejects.jsonl" in res.stdout
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and "--max-reject-fraction 0.05" in err
    # The rejected records' turns fail the turn coverage too: accepting them takes both options.
    assert "fix: pass --chat-template qwen2_vl_tools" in err
    assert err.endswith("--max-reject-fraction 1 --min-turn-coverage 0 accepts it")

    # Both options: exit 0, the same dataset (the options change no byte); only the failed build's note goes.
    before = tree_hashes(bare)
    assert before.pop("build-failed.txt")
    res = invoke(
        "build",
        "--in",
        demo8,
        "--out",
        bare,
        "--no-progress",
        *AGENT,
        "--max-reject-fraction",
        "1",
        "--min-turn-coverage",
        "0",
    )
    assert res.exit_code == 0, res.output
    assert tree_hashes(bare) == before


def test_check_rejects_threshold_and_allow_empty():
    def manifest(records, rejected, samples, reason="image_not_found"):
        return a_manifest(
            totals={"records": records, "rejected": rejected, "samples": samples},
            rejects={reason: rejected} if rejected else {},
        )

    check_rejects(manifest(100, 5, 95), "d", allow_empty=False, max_reject_fraction=0.05)  # 5% is not > 5%
    with pytest.raises(
        RejectsError,
        match=r"rejected 6 of 100 records \(6.0% > --max-reject-fraction 0.05: "
        r"image_not_found 6\); fix: .*--image-root",
    ):
        check_rejects(manifest(100, 6, 94), "d", allow_empty=False, max_reject_fraction=0.05)
    check_rejects(manifest(100, 99, 1), "d", allow_empty=False, max_reject_fraction=1.0)
    # 0 samples: its own message (and --allow-empty, which also waives the share: nothing landed on purpose)
    with pytest.raises(RejectsError, match="0 samples written from 3 records .*--allow-empty"):
        check_rejects(manifest(3, 3, 0), "d", allow_empty=False, max_reject_fraction=1.0)
    check_rejects(manifest(3, 3, 0), "d", allow_empty=True, max_reject_fraction=0.05)
    check_rejects(manifest(0, 0, 0), "d", allow_empty=True, max_reject_fraction=0.05)


@pytest.mark.slow  # make test-all; long in make test (issue 33's 8-minute budget)
def test_out_of_another_build_or_unrelated_files_is_refused_unchanged(tmp_path, fresh_processor):
    inp = text_records(tmp_path / "in.jsonl")
    out = tmp_path / "ds"
    assert invoke("build", "--in", inp, "--out", out, "--no-progress", "--seq-len", "256").exit_code == 0
    before = state(out)
    res = invoke("build", "--in", inp, "--out", out, "--no-progress", "--seq-len", "512")
    assert res.exit_code == 1 and res.stderr.count("\n") == 2  # the start-up line and the one-line refusal
    assert "--seq-len 256 there, 512 asked" in res.stderr and "--overwrite" in res.stderr
    assert state(out) == before
    # the same build again is no refusal (a complete dataset stays as it is; a killed one resumes: test_resume.py)
    assert invoke("build", "--in", inp, "--out", out, "--no-progress", "--seq-len", "256").exit_code == 0
    assert state(out) == before
    res = invoke("build", "--in", inp, "--out", out, "--no-progress", "--seq-len", "512", "--overwrite")
    assert res.exit_code == 0 and json.loads((out / "manifest.json").read_text())["config"]["seq_len"] == 512

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a dataset")
    (mine / "sub").mkdir()
    before = state(mine)
    res = invoke("build", "--in", inp, "--out", mine, "--no-progress")
    assert res.exit_code == 1 and "holds files no vlmprep build wrote (notes.txt, sub)" in res.stderr
    assert state(mine) == before
    # --overwrite builds beside the user's files and never deletes one, even where its name looks like build output.
    for name in ("other.tar", "scratch.tmp", "old.tar.tmp"):
        (mine / name).write_text("the user's")
    res = invoke("build", "--in", inp, "--out", mine, "--no-progress", "--overwrite")
    assert res.exit_code == 0 and (mine / "manifest.json").is_file(), res.stderr
    assert all((mine / n).read_text() == "the user's" for n in ("other.tar", "scratch.tmp", "old.tar.tmp"))
    assert (mine / "notes.txt").read_text() == "not a dataset"


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--in", "{tmp}/nope.jsonl"], "input not found: {tmp}/nope.jsonl"),
        (
            ["--in", "{inp}", "--processor", "{tmp}/no/such/processor"],
            "--processor {tmp}/no/such/processor: no such directory",
        ),
        (
            ["--in", "{inp}", "--chat-template", "{tmp}/none.jinja"],
            "--chat-template {tmp}/none.jinja: no such file or bundled template",
        ),
        (
            ["--in", "{inp}", "--chat-template", "qwen9_tools"],
            "no such file or bundled template; pass a .jinja file or one of",
        ),
        (["--in", "{inp}", "--role-boundaries", "{tmp}/none.toml"], "--role-boundaries {tmp}/none.toml: no such file"),
        (["--in", "{inp}", "--image-root", "{tmp}/imgs"], "--image-root {tmp}/imgs: no such directory"),
    ],
)
def test_missing_paths_are_one_line_and_leave_no_out(args, msg, tmp_path, monkeypatch):
    monkeypatch.delenv("VLMPREP_DEBUG", raising=False)
    inp = text_records(tmp_path / "in.jsonl")
    out = tmp_path / "o"
    res = invoke("build", "--out", out, "--no-progress", *[a.format(tmp=tmp_path, inp=inp) for a in args])
    assert res.exit_code == 1, res.output
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and msg.format(tmp=tmp_path) in err and "Traceback" not in res.stderr
    assert not out.exists()


def test_a_failed_processor_load_removes_the_out_it_created(tmp_path, monkeypatch):
    def boom(spec):
        raise ValueError("cannot load it")

    monkeypatch.setattr("vlmprep.builder.pipeline.load_processor", boom)
    inp = text_records(tmp_path / "in.jsonl")
    res = invoke("build", "--in", inp, "--out", tmp_path / "a" / "b", "--no-progress")
    assert res.exit_code == 1 and "cannot load it" in res.stderr and not (tmp_path / "a").exists()


def test_bundled_templates_by_name():
    assert resolve_chat_template("qwen2_vl_tools") == TEMPLATES_DIR / "qwen2_vl_tools.jinja"
    assert resolve_chat_template("qwen2_vl_tools.jinja") == TEMPLATES_DIR / "qwen2_vl_tools.jinja"
    assert resolve_chat_template(str(TEMPLATES_DIR / "qwen3_vl.jinja")) == TEMPLATES_DIR / "qwen3_vl.jinja"
    with pytest.raises(ValueError, match="qwen2_vl_tools"):
        resolve_chat_template("../qwen2_vl_tools")


def test_build_help_lists_every_builtin_in_panels_and_choices_are_checked_at_parse_time(monkeypatch):
    from vlmprep.processors.builtin import builtin_names

    monkeypatch.setenv("COLUMNS", "200")
    res = invoke("build", "--help")
    assert res.exit_code == 0
    text = re.sub(r"\s+", " ", res.stdout.replace("│", " "))
    assert len(builtin_names()) >= 7 and all(f"builtin:{n}" in text for n in builtin_names())
    for panel in ("Input", "Rendering and masks", "Images", "Agent traces", "Limits", "Output", "Scale-out"):
        assert f"─ {panel} ─" in res.stdout
    assert "pip install 'vlmprep[ray]'" in text and "qwen2_vl_tools" in text
    bad = invoke("build", "--in", "x.jsonl", "--out", "o", "--image-format", "jpeg")
    assert bad.exit_code == 2 and "'jpeg' is not one of" in bad.output
    bad = invoke("build", "--in", "x.jsonl", "--out", "o", "--keep-images", "first:2")
    assert bad.exit_code == 2 and "last:N" in bad.output


def test_inspect_raw_input_takes_the_agent_trace_options(demo8, fresh_processor):
    res = invoke(
        "inspect",
        demo8,
        "--index",
        1,
        "--chat-template",
        "qwen2_vl_tools",
        "--long-traces",
        "split",
        "--keep-images",
        "last:1",
        "--dropped-image-text",
        "[earlier]",
        "--seq-len",
        4096,
    )
    assert res.exit_code == 0, res.output
    assert "[earlier]" in res.stdout


def test_summary_plurals():
    shard = ShardEntry(
        name="shard-000000.tar",
        num_samples=1,
        num_tokens=1,
        num_trainable_tokens=1,
        num_images=1,
        bytes=1,
        sha256="0" * 64,
    )
    m = a_manifest(
        totals={
            k: 1
            for k in (
                "samples",
                "records",
                "tokens",
                "trainable_tokens",
                "images",
                "image_tokens",
                "truncated_samples",
                "dropped_images",
                "unrendered_tool_call_turns",
            )
        }
        | {"rejected": 0},
        shards=(shard,),
        image_format="zstd",
        format_version=2,
    )
    s = format_build_summary(m, "d")
    assert s.startswith("built d: 1 sample in 1 shard (") and "rejected          0 of 1 record (0.0%)" in s


def test_progress_bar_shows_the_total_and_an_eta(monkeypatch):
    import io
    import time

    import rich.progress
    from rich.console import Console

    from vlmprep.builder.progress import record_progress
    from vlmprep.config import BuildConfig

    buf = io.StringIO()

    class Captured(rich.progress.Progress):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "console": Console(file=buf, width=160, force_terminal=True)})

    monkeypatch.setattr(rich.progress, "Progress", Captured)
    with record_progress(BuildConfig(inputs=("x",), out="o", progress=True)) as p:
        bar = p.add_task("build", total=64, rate=2.0, samples=10, rejects=1, completed=0)
        for _ in range(10):
            p.update(bar, advance=1)
            time.sleep(0.02)
    last = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue()).strip().splitlines()[-1]
    assert re.search(r"10/64 records .* eta \d+:\d\d:\d\d", last), last


def test_merge_checks_the_share_over_the_whole_dataset(single, tmp_path):
    """The task traces hold a broken line and an id repeated across tasks (only merge sees it): over the threshold."""
    import shutil

    d = tmp_path / "ds"
    shutil.copytree(single, d)
    m = Manifest.from_json(json.loads((d / "manifest.json").read_text()))
    n, records = rejected_records(m), m.totals["records"]
    assert n / records > 0.05 and m.rejects.get("duplicate_id")
    res = invoke("merge", d)
    assert res.exit_code == 1 and f"rejected          {n} of {records} records" in res.stdout
    assert f"error: {d}: rejected {n} of {records} records" in res.stderr and "fix: " in res.stderr
    # The rejected records' turns fail the turn coverage too: the line names both options, which accept it.
    assert res.stderr.strip().endswith("--max-reject-fraction 1 --min-turn-coverage 0 accepts it")
    res = invoke("merge", d, "--max-reject-fraction", "1")
    assert res.exit_code == 1 and "lost with rejected records: " in res.stderr
    assert invoke("merge", d, "--max-reject-fraction", "1", "--min-turn-coverage", "0").exit_code == 0
