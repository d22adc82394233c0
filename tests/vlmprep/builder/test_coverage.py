"""Lost turns fail a build as rejected records do: every trained turn is kept by default (--long-traces split); a
build that loses more than --min-turn-coverage allows (truncation asked for, an image too large for --seq-len) writes
everything, then exits 1 naming the share, the reasons and the fix, and `merge` and `stats` judge it the same way.
A failed build's --out is rebuilt by pasting its own fix line; a good dataset is never replaced unasked."""

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from tests.vlmprep.builder.conftest import invoke, state
from tests.vlmprep.conftest import a_manifest
from vlmprep.config import BuildConfig
from vlmprep.shards.summary import coverage_problem

REAL = Path("/work/shared/data/real_traces")


def _manifest(trained, truncated=0, too_long=0, policy=0, rejected=0, *, long_traces="truncate", large=0, rejects=None):
    return a_manifest(
        turns={
            "trained_assistant_turns": trained,
            "lost": {
                "truncated": truncated,
                "turn_too_long": too_long,
                "not_trained_by_policy": policy,
                "record_rejected": rejected,
            },
        },
        totals={
            "turns_lost_truncated": truncated,
            "turns_lost_too_long": too_long,
            "turns_lost_rejected": rejected,
            "turns_lost_large_image": large,
        },
        config={"seq_len": 8192, "long_traces": long_traces},
        rejects=rejects or {},
    )


def test_the_rule_counts_turns_lost_to_seq_len_and_names_the_fix():
    assert BuildConfig(inputs=("x",), out="o").long_traces == "split"
    assert BuildConfig(inputs=("x",), out="o").min_turn_coverage == 0.95
    assert coverage_problem(_manifest(95, truncated=5), 0.95) is None  # 95% is not < 95%
    msg = coverage_problem(_manifest(618, truncated=270), 0.95)
    assert msg == (
        "turn coverage 69.6% < --min-turn-coverage 0.95 (618 of 888 assistant turns trained; lost to "
        "--seq-len 8192: truncated 270); fix: drop --long-traces truncate (split, the default, trains "
        "every turn in step samples), or pass --keep-images last:3 so that traces fit"
    )
    # Turns the policy leaves untrained are asked for; rejected records' turns are lost (duplicates included), and
    # where they are most of the loss the fix is the most common reject's.
    assert coverage_problem(_manifest(10, policy=90), 0.95) is None
    msg = coverage_problem(
        _manifest(
            10,
            policy=90,
            rejected=50,
            too_long=1,
            rejects={"turn_too_long": 1, "image_not_found": 3, "duplicate_id": 7},
        ),
        0.95,
    )
    assert msg == (
        "turn coverage 16.4% < --min-turn-coverage 0.95 (10 of 61 assistant turns trained; lost to "
        "--seq-len 8192: turn_too_long 1; lost with rejected records: 50); fix: duplicate_id is the most "
        "common reject (7): give every record a unique id (or leave id out: one is derived from file and "
        "line)"
    )
    msg = coverage_problem(_manifest(4, too_long=2, long_traces="split", large=2), 0.95)
    assert "(4 of 6 assistant turns trained; lost to --seq-len 8192: turn_too_long 2)" in msg
    assert msg.endswith(
        "fix: pass --max-pixels 1605632 (images over half of --seq-len 8192 cost these turns; this "
        "caps one at a quarter of it), or raise --seq-len"
    )
    msg = coverage_problem(_manifest(4, too_long=2, long_traces="split"), 0.95)
    assert msg.endswith("fix: pass --keep-images last:3 to drop older screenshots, or raise --seq-len")
    assert coverage_problem(_manifest(0), 0.95) is None and coverage_problem(_manifest(1, truncated=99), 0) is None


def test_truncation_is_opt_in_and_a_lossy_build_exits_1_with_the_share_merge_and_stats_agree(
    demo8, tmp_path, fresh_processor
):
    args = ["--in", demo8, "--no-progress", "--chat-template", "qwen2_vl_tools", "--seq-len", "1024"]
    res = invoke("build", *args, "--out", tmp_path / "split")
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "split" / "manifest.json").read_text())
    assert m["config"]["long_traces"] == "split" and m["turns"]["coverage"] == 1.0 and m["totals"]["split_samples"]

    cut = tmp_path / "cut"
    res = invoke("build", *args, "--out", cut, "--long-traces", "truncate")
    assert res.exit_code == 1
    turns = json.loads((cut / "manifest.json").read_text())["turns"]  # everything is written
    trained, lost = turns["trained_assistant_turns"], turns["lost"]["truncated"]
    line = (
        f"turn coverage {trained / (trained + lost):.1%} < --min-turn-coverage 0.95 ({trained} of "
        f"{trained + lost} assistant turns trained; lost to --seq-len 1024: truncated {lost}); fix: drop "
        "--long-traces truncate"
    )
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: {cut}: {line}") and err.endswith("--min-turn-coverage 0 accepts it"), err
    assert f"assistant turns   {trained} of {turns['input_assistant_turns']} trained" in res.stdout  # the summary
    assert (cut / "build-failed.txt").read_text() == err[len("error: ") :] + "\n"

    res = invoke("stats", cut)  # stats warns the same way, at the build's default threshold
    assert res.exit_code == 0 and f"WARNING: {line}" in res.stdout
    res = invoke("merge", cut)  # merge judges the whole dataset as build does
    assert res.exit_code == 1 and f"error: {cut}: {line}" in res.stderr
    res = invoke("merge", cut, "--min-turn-coverage", "0")
    assert res.exit_code == 0 and not (cut / "build-failed.txt").exists()


def _big_image_records(d: Path) -> Path:
    """Two records whose task screenshot (1280x720: 1196 Qwen2-VL tokens) is over half of --seq-len 512, and a text
    record that fits."""
    Image.new("RGB", (1280, 720), (40, 90, 160)).save(d / "page.png")
    image = {"type": "image_url", "image_url": {"url": "page.png"}}
    records = [
        {
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": f"task {i}: what is on the page?"}]},
                {"role": "assistant", "content": "a blue page"},
                {"role": "user", "content": "and now?"},
                {"role": "assistant", "content": "still blue"},
            ],
        }
        for i in range(2)
    ]
    records.append(
        {
            "id": "text",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "ciao"},
            ],
        }
    )
    (d / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d / "big.jsonl"


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_an_image_too_large_for_seq_len_points_to_max_pixels_and_the_pasted_fix_builds(tmp_path, fresh_processor):
    inp, out = _big_image_records(tmp_path), tmp_path / "ds"
    res = invoke("build", "--in", inp, "--out", out, "--no-progress", "--seq-len", "512")
    assert res.exit_code == 1
    err = res.stderr.strip().splitlines()[-1]
    assert (
        "turn coverage 33.3% < --min-turn-coverage 0.95 (2 of 6 assistant turns trained; lost to --seq-len 512: "
        "turn_too_long 4)"
    ) in err
    reject = json.loads((out / "rejects.jsonl").read_text().splitlines()[0])
    assert reject["reason"] == "turn_too_long" and "an image of 1196 tokens: lower --max-pixels" in reject["message"]
    fix = re.search(r"fix: pass (--max-pixels \d+) \(", err).group(1)
    assert fix == "--max-pixels 100352"
    res = invoke("build", "--in", inp, "--out", out, "--no-progress", "--seq-len", "512", *fix.split())
    assert res.exit_code == 0, res.output
    assert json.loads((out / "manifest.json").read_text())["turns"]["coverage"] == 1.0
    assert "replacing the dataset in" in res.stderr and not (out / "build-failed.txt").exists()
    # Truncated instead: the record loses every trained token; the reject's fix is the same pixel budget.
    res = invoke(
        "build",
        "--in",
        inp,
        "--out",
        tmp_path / "cut",
        "--no-progress",
        "--seq-len",
        "512",
        "--long-traces",
        "truncate",
    )
    assert res.exit_code == 1 and "no_trainable_tokens_after_truncation 2); fix: pass --max-pixels 100352" in res.stderr


def test_a_failed_builds_fix_line_pasted_builds_and_a_good_dataset_is_never_replaced_unasked(
    demo8, tmp_path, fresh_processor
):
    out = tmp_path / "ds"
    res = invoke("build", "--in", demo8, "--out", out, "--no-progress", "--keep-images", "last:3")
    assert res.exit_code == 1  # the README's mistake: agent traces without the tool-aware template
    fix = re.search(r"fix: pass (--chat-template qwen2_vl_tools) ", res.stderr).group(1)
    res = invoke("build", "--in", demo8, "--out", out, "--no-progress", "--keep-images", "last:3", *fix.split())
    assert res.exit_code == 0, res.output
    assert (
        "which failed its checks (build-failed.txt), with one built with --chat-template qwen2_vl_tools" in res.stderr
    )
    assert json.loads((out / "manifest.json").read_text())["config"]["chat_template"] == "qwen2_vl_tools"
    # Now a good dataset: another option is refused unchanged, values spelled as typed and unset ones as such.
    before = state(out)
    res = invoke("build", "--in", demo8, "--out", out, "--no-progress")
    assert res.exit_code == 1 and state(out) == before
    assert (
        "--chat-template qwen2_vl_tools there, not set asked, --keep-images last:3 there, all asked); pass --overwrite"
    ) in res.stderr
    assert "None" not in res.stderr


@pytest.mark.slow  # four builds of the real trajectories (~1-2 min each on 2 cores)
def test_real_agent_trajectories_with_defaults_train_95pct_of_their_turns_or_fail_naming_the_fix(
    tmp_path, fresh_processor
):
    """OpenCUA and WebVoyager built as docs/build.md says (defaults plus the tool-aware template) train >= 95% of
    their assistant turns; OpenCUA truncated (the old default) exits 1 naming the share and the fix."""
    for name in ("opencua", "webvoyager"):
        res = invoke(
            "build",
            "--in",
            REAL / f"{name}.jsonl",
            "--out",
            tmp_path / name,
            "--no-progress",
            "--chat-template",
            "qwen2_vl_tools",
        )
        assert res.exit_code == 0, res.output
        turns = json.loads((tmp_path / name / "manifest.json").read_text())["turns"]
        assert turns["coverage"] >= 0.95 and turns["input_assistant_turns"] >= 69, (name, turns)
    res = invoke(
        "build",
        "--in",
        REAL / "opencua.jsonl",
        "--out",
        tmp_path / "cut",
        "--no-progress",
        "--chat-template",
        "qwen2_vl_tools",
        "--long-traces",
        "truncate",
    )
    assert res.exit_code == 1
    assert (
        "turn coverage 34.8% < --min-turn-coverage 0.95 (24 of 69 assistant turns trained; lost to --seq-len "
        "8192: truncated 45); fix: drop --long-traces truncate"
    ) in res.stderr
    # SeeAct's 1280x5808 page is ~10.6k tokens at the default pixel budget: longer than --seq-len 8192 alone.
    res = invoke(
        "build",
        "--in",
        REAL / "seeact.jsonl",
        "--out",
        tmp_path / "seeact",
        "--no-progress",
        "--chat-template",
        "qwen2_vl_tools",
    )
    assert res.exit_code == 1 and "turn_too_long 2); fix: pass --max-pixels 1605632" in res.stderr
    res = invoke(
        "build",
        "--in",
        REAL / "seeact.jsonl",
        "--out",
        tmp_path / "seeact",
        "--no-progress",
        "--chat-template",
        "qwen2_vl_tools",
        "--max-pixels",
        "1605632",
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "seeact" / "manifest.json").read_text())["turns"]["coverage"] == 1.0


def test_an_unknown_option_names_the_close_one():
    res = invoke("build", "--in", "x.jsonl", "--out", "o", "--long-trace", "split")
    assert res.exit_code == 2 and "No such option: --long-trace" in res.output and "--long-traces" in res.output
    res = invoke("merge", "o", "--min-turn-coverag", "0")
    assert res.exit_code == 2 and "--min-turn-coverage" in res.output
