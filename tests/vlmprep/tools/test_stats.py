import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from vlmprep.builder.pipeline import build
from vlmprep.cli import app
from vlmprep.config import BuildConfig


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """6 demo traces (some truncated at 1024 tokens) in traces.jsonl, and 3 bad records in a second input file."""
    from scripts.demo_traces import generate_traces

    d = tmp_path_factory.mktemp("stats")
    recs = list(
        generate_traces(
            n=6,
            seed=1,
            min_images=1,
            max_images=3,
            width=320,
            height=200,
            overlong_fraction=0.2,
            text_only_fraction=0.1,
        )
    )
    no_answer = {"messages": [{"role": "user", "content": "hi"}]}
    inp, bad = d / "traces.jsonl", d / "bad.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    bad.write_text("\n".join(["[1, 2]", "{broken", json.dumps(no_answer)]) + "\n")
    out = d / "shards"
    build(
        BuildConfig(
            inputs=(str(inp), str(bad)),
            out=str(out),
            seq_len=1024,
            samples_per_shard=3,
            tool_calls="train-content",
            progress=False,
            max_reject_fraction=1.0,  # bad lines on purpose,
            long_traces="truncate",
            min_turn_coverage=0.0,
        )
    )  # and truncated samples
    return out


def recompute(out):
    """Per-sample and per-image values straight from the tars with tarfile + np.load, independent of vlmprep's
    reader: tokens, trained tokens, image tokens, images per sample; tokens per image (qwen2-vl: t*h*w / 2^2 of its
    grid row, and its two wrappers) and source sizes; truncated and dropped counts; rejects by reason."""
    per = {"tokens": [], "trained": [], "images": [], "image_tokens": [], "tokens_per_image": [], "sizes": []}
    truncated = dropped = 0
    marked, wrappers = {}, {}
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                data = tf.extractfile(m).read()
                if ext == "loss_mask.npy":
                    mask = np.load(io.BytesIO(data))
                    per["tokens"].append(len(mask))
                    per["trained"].append(int(mask.sum()))
                elif ext == "mm_token_type_ids.npy":  # an image's unit: its placeholders and 2 wrappers
                    marked[key] = int(np.load(io.BytesIO(data)).sum())
                elif ext == "image_grid_thw.npy":
                    grid = np.load(io.BytesIO(data)).reshape(-1, 3)
                    per["images"].append(len(grid))
                    per["tokens_per_image"] += [int(g.prod()) // 4 + 2 for g in grid]
                    wrappers[key] = 2 * len(grid)
                elif ext == "json":
                    meta = json.loads(data)
                    truncated += meta["truncated"]
                    dropped += meta["dropped_images"]
                    per["sizes"] += [f"{im['source_width']}x{im['source_height']}" for im in meta["images"]]
    per["image_tokens"] = [marked[k] + wrappers[k] for k in marked]
    rejects = {}
    for line in (out / "rejects.jsonl").read_text().splitlines():
        r = json.loads(line)["reason"]
        rejects[r] = rejects.get(r, 0) + 1
    return {k: np.array(v) for k, v in per.items()}, truncated, dropped, rejects


def nearest_rank(values, q):
    srt = np.sort(values)
    return srt[int(np.ceil(q / 100 * len(srt))) - 1]


def test_stats_equal_totals_recomputed_from_shards(built):
    per, truncated, dropped, rejects = recompute(built)
    tokens, images = per["tokens"], per["images"]
    trained, image_tokens = per["trained"].sum(), per["image_tokens"].sum()
    assert truncated >= 1 and dropped >= 1 and (images == 0).any() and len(rejects) == 3

    res = CliRunner().invoke(app, ["stats", str(built), "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)
    assert st["samples"] == len(tokens) and st["tokens"] == tokens.sum()
    assert st["trainable_tokens"] == trained and st["image_tokens"] == image_tokens
    assert st["trainable_ratio"] == pytest.approx(trained / tokens.sum())
    assert st["images"] == images.sum() and st["text_only_samples"] == (images == 0).sum()
    assert st["images_per_sample"]["max"] == images.max()
    assert st["truncated_samples"] == truncated and st["dropped_images"] == dropped
    assert st["rejects"] == rejects and st["rejected"] == sum(rejects.values())
    assert st["records"] == len(tokens) + sum(rejects.values())
    tps = st["tokens_per_sample"]
    for q in (50, 90, 99):  # nearest rank
        assert tps[f"p{q}"] == nearest_rank(tokens, q)
    assert tps["max"] == tokens.max() and tps["min"] == tokens.min()
    hist = tps["histogram"]
    assert sum(b["count"] for b in hist) == len(tokens)
    assert all(sum(b["lo"] <= t < b["hi"] for t in tokens) == b["count"] for b in hist)
    assert st["mismatches"] == []

    text = CliRunner().invoke(app, ["stats", str(built)]).stdout
    assert f"records            {st['records']} read, {len(tokens)} samples, {st['rejected']} rejected" in text
    assert f"tokens             {tokens.sum()} | trained {trained} ({trained / tokens.sum():.1%})" in text
    assert f"truncated          {truncated} sample{'s' * (truncated != 1)} (" in text
    assert f"{dropped} image{'s' * (dropped != 1)} dropped by the cut" in text
    for reason, n in rejects.items():
        assert any(line.split() == [reason, str(n)] for line in text.splitlines())
    assert "tokens per sample histogram:" in text and "#" in text and "WARNING: manifest" not in text
    # The truncated turns' warning (the build accepted them with --min-turn-coverage 0), by the build's own rule.
    st = json.loads(CliRunner().invoke(app, ["stats", str(built), "--json"]).stdout)
    assert f"WARNING: {st['coverage_warning']}" in text.splitlines()
    assert (
        st["coverage_warning"].startswith("turn coverage ") and "< --min-turn-coverage 0.95" in st["coverage_warning"]
    )


def test_stats_distributions_of_tokens_trained_tokens_images_and_image_sizes(built):
    """Per sample: tokens, trained tokens, images; per image: tokens and source size; each with nearest-rank
    percentiles and a histogram, in --json and in the terminal."""
    per, _, _, _ = recompute(built)
    st = json.loads(CliRunner().invoke(app, ["stats", str(built), "--json"]).stdout)
    for key, values in (
        ("tokens_per_sample", per["tokens"]),
        ("trained_tokens_per_sample", per["trained"]),
        ("images_per_sample", per["images"]),
        ("tokens_per_image", per["tokens_per_image"]),
    ):
        d = st[key]
        assert d["count"] == len(values) and d["min"] == values.min() and d["max"] == values.max(), key
        assert d["mean"] == pytest.approx(values.mean()), key
        assert [d[f"p{q}"] for q in (10, 50, 90, 99)] == [nearest_rank(values, q) for q in (10, 50, 90, 99)], key
        assert [sum(b["lo"] <= v < b["hi"] for v in values) for b in d["histogram"]] == [
            b["count"] for b in d["histogram"]
        ], key
        assert sum(b["count"] for b in d["histogram"]) == len(values), key
    assert st["image_sizes"] == {
        "kind": "source",
        "distinct": 1,
        "top": [{"size": "320x200", "count": len(per["sizes"])}],
    }
    assert set(per["sizes"]) == {"320x200"}

    text = CliRunner().invoke(app, ["stats", str(built)]).stdout.splitlines()
    row = next(line for line in text if line.strip().startswith("trained tokens per sample"))
    d = st["trained_tokens_per_sample"]
    assert row.split()[4:] == [str(d[k]) for k in ("min", "p10", "p50", "p90", "p99", "max")] + [f"{d['mean']:.1f}"]
    assert f"image sizes (source WxH, images): 320x200 {len(per['sizes'])}" in text
    assert "tokens per image histogram:" in text


def test_stats_per_input_file(built):
    """Each input file's records, samples, rejects (by reason, from rejects.jsonl), turns and truncation; the
    files' counts add up to the dataset's."""
    st = json.loads(CliRunner().invoke(app, ["stats", str(built), "--json"]).stdout)
    inputs = {i["name"]: i for i in st["inputs"]}
    assert list(inputs) == ["traces.jsonl", "bad.jsonl"]
    traces, bad = inputs["traces.jsonl"], inputs["bad.jsonl"]
    per, truncated, _, rejects = recompute(built)
    assert (traces["records"], traces["samples"], traces["rejected"], traces["rejects"]) == (
        6,
        len(per["tokens"]),
        0,
        {},
    )
    assert (bad["records"], bad["samples"], bad["rejected"]) == (3, 0, 3) and bad["rejects"] == rejects
    assert traces["tokens"] == per["tokens"].sum() and traces["trainable_tokens"] == per["trained"].sum()
    assert traces["images"] == per["images"].sum() and traces["truncated_samples"] == truncated
    turns = st["turns"]
    assert traces["input_assistant_turns"] == turns["input_assistant_turns"] > 0
    assert traces["trained_assistant_turns"] == turns["trained_assistant_turns"]
    assert traces["coverage"] == pytest.approx(turns["coverage"]) and bad["coverage"] == 1.0
    assert traces["turns_lost"] == turns["lost"]
    manifest = json.loads((built / "manifest.json").read_text())
    for key, total in manifest["totals"].items():  # the per-input totals are the totals, split by file
        assert sum(i["totals"].get(key, 0) for i in manifest["inputs"]) == total, key

    text = CliRunner().invoke(app, ["stats", str(built)]).stdout.splitlines()
    head = text.index("per input file:")
    assert text[head + 1].split() == [
        "file",
        "records",
        "samples",
        "rejected",
        "turns",
        "trained",
        "coverage",
        "truncated",
        "images",
        "tokens",
        "trained",
    ]
    assert text[head + 2].split() == [
        "traces.jsonl",
        "6",
        str(traces["samples"]),
        "0",
        str(traces["trained_assistant_turns"]),
        "of",
        str(traces["input_assistant_turns"]),
        f"{traces['coverage']:.1%}",
        str(truncated),
        str(traces["images"]),
        str(traces["tokens"]),
        str(traces["trainable_tokens"]),
    ]
    assert text[head + 3].split()[:4] == ["bad.jsonl", "3", "0", "3"]


def test_stats_of_a_dataset_without_per_input_counts_says_so_in_one_line(built, tmp_path):
    """A dataset built before the manifest carried each input's totals: the per-file view is one line, the rest
    as before."""
    old = tmp_path / "old"
    shutil.copytree(built, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for inp in manifest["inputs"]:
        del inp["totals"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(app, ["stats", str(old)])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stdout.splitlines() if line.startswith("per input file")]
    assert lines == [
        "per input file     unavailable: this dataset was built before vlmprep recorded per-input "
        "counts (rebuild to see them)"
    ]
    st = json.loads(CliRunner().invoke(app, ["stats", str(old), "--json"]).stdout)
    assert st["inputs"] is None and st["mismatches"] == [] and st["samples"] > 0


def test_stats_flags_a_manifest_that_disagrees_with_the_shards(built, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(built, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["totals"]["tokens"] += 1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(app, ["stats", str(bad)])
    assert res.exit_code == 0
    assert f"WARNING: manifest totals.tokens={manifest['totals']['tokens']} but the shards give " in res.stdout


def test_stats_on_a_dir_that_is_not_a_build_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(app, ["stats", str(tmp_path)])
    assert res.exit_code == 1
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and "manifest.json" in res.stderr


def _input(name, trained, of, *, samples=2, truncated=0, rejects=None, cut=None):
    """An input file's counts; `cut` turns lost to --seq-len (default: every untrained turn)."""
    rejects = rejects or {}
    cut = of - trained if cut is None else cut
    return {
        "name": name,
        "path": f"/d/{name}",
        "trained_assistant_turns": trained,
        "input_assistant_turns": of,
        "coverage": trained / of if of else 1.0,
        "kept_share": trained / (trained + cut) if trained + cut else 1.0,
        "samples": samples,
        "truncated_samples": truncated,
        "rejected": sum(rejects.values()),
        "rejects": rejects,
    }


def _stats(inputs, *, floor=0.95, samples=10, truncated=0, large=None, dataset_line=None):
    return {
        "min_turn_coverage": floor,
        "inputs": inputs,
        "samples": samples,
        "truncated_samples": truncated,
        "dropped_images": 3 * truncated,
        "coverage_warning": dataset_line,
        "large_images": large or {"limit": 4096, "count": 0, "largest": None, "max_pixels": None},
    }


def test_warnings_name_the_low_coverage_files_the_truncated_share_and_large_images():
    """The dataset's line is the build's rule (coverage_problem); each input file under the floor by the same rule
    (trained of the turns to train: those --seq-len lost count, a rejected record's do not), lowest first."""
    from vlmprep.tools.stats import COVERAGE_FIX, data_warnings

    inputs = [
        _input("opencua.jsonl", 24, 69, samples=6, truncated=6),
        _input("webvoyager.jsonl", 88, 90, samples=15, truncated=2),
        _input("seeact.jsonl", 4, 6, rejects={"no_trainable_tokens_after_truncation": 1}, cut=1),
    ]
    large = {
        "limit": 4096,
        "count": 5,
        "max_pixels": 3211264,
        "largest": {"tokens": 9524, "size": "1280x5808", "file": "/d/seeact.jsonl"},
    }
    assert data_warnings(_stats(inputs, samples=23, truncated=8, large=large, dataset_line="DATASET")) == [
        "DATASET",
        "opencua.jsonl: 24 of 69 assistant turns trained (34.8% of those to train < 0.95; 6 of 6 samples truncated, "
        "0 rejected)",
        "seeact.jsonl: 4 of 6 assistant turns trained (80.0% of those to train < 0.95; 0 of 2 samples truncated, "
        "1 rejected: no_trainable_tokens_after_truncation 1)",
        "8 of 23 samples truncated (34.8% > 10%; opencua.jsonl 6 of 6, webvoyager.jsonl 2 of 15), 24 images dropped "
        f"by the cut; fix: {COVERAGE_FIX}",
        "5 images over 4096 tokens (largest 9524: 1280x5808 in seeact.jsonl); fix: --max-pixels 3211264 caps an image "
        "at 4096 tokens",
    ]
    # A rejected record's turns are the reject threshold's business, not coverage's.
    assert not any(w.startswith("seeact") for w in data_warnings(_stats([inputs[0], {**inputs[2], "kept_share": 1.0}])))
    # The threshold is the dataset's own (the build's --min-turn-coverage, in the manifest config).
    two = [inputs[1], _input("demo.jsonl", 12, 12)]
    assert data_warnings(_stats(two, floor=0.95)) == []
    assert [w.split(":")[0] for w in data_warnings(_stats(two, floor=0.99))] == ["webvoyager.jsonl"]
    # One input file with turns (others may hold none, e.g. only broken records): its line would repeat the dataset's.
    assert data_warnings(_stats(inputs[:1], dataset_line="DATASET")) == ["DATASET"]
    assert data_warnings(_stats([inputs[0], _input("broken.jsonl", 0, 0)], dataset_line="DATASET")) == ["DATASET"]
    # Older datasets (no per-input counts): the dataset's line only.
    assert data_warnings({**_stats(inputs, dataset_line="DATASET"), "inputs": None}) == ["DATASET"]


def test_the_coverage_threshold_comes_from_the_manifest(built, tmp_path):
    from vlmprep.tools.stats import MIN_TURN_COVERAGE, compute_stats

    assert compute_stats(built)["min_turn_coverage"] == MIN_TURN_COVERAGE == 0.95
    strict = tmp_path / "strict"
    shutil.copytree(built, strict)
    manifest = json.loads((strict / "manifest.json").read_text())
    manifest["config"]["min_turn_coverage"] = 1.0
    (strict / "manifest.json").write_text(json.dumps(manifest))
    st = compute_stats(strict)
    assert st["min_turn_coverage"] == 1.0
    if st["turns"]["coverage"] < 1.0:
        assert any(w.startswith("turn coverage ") and "< --min-turn-coverage 1 " in w for w in st["warnings"])
    manifest["config"]["min_turn_coverage"] = "all"  # untrusted: not a share, so the default
    (strict / "manifest.json").write_text(json.dumps(manifest))
    assert compute_stats(strict)["min_turn_coverage"] == MIN_TURN_COVERAGE


class _FakeStored:
    """What stats reads of a stored sample: its meta, arrays and member sizes (each image member's, 1000 bytes)."""

    def __init__(self, meta, types):
        for k, im in enumerate(meta["images"]):
            im.setdefault("member", f"img{k:03d}.pdelta.zst")
        self._meta, self._types = meta, np.asarray(types, dtype=np.uint8)
        self.sizes = {im["member"]: 1000 for im in meta["images"]}

    def meta(self):
        return self._meta

    def array(self, name):
        return {
            "loss_mask": np.ones(len(self._types), np.uint8),
            "mm_token_type_ids": self._types,
            "image_grid_thw": np.ones((len(self._meta["images"]), 3), np.int32),
        }[name]


def test_image_sizes_and_tokens_per_image_from_one_sample():
    """Tokens per image are the placeholder runs; a source size where the meta records one, else (older datasets)
    the stored size; an image over the limit (a quarter of --seq-len) is counted with its file and size."""
    from vlmprep.tools.stats import _Scan

    big = 2048 + 1
    images = [
        {"width": 56, "height": 28, "source_width": 100, "source_height": 50},
        {"width": 28 * big, "height": 28, "source_width": 5000, "source_height": 30},
    ]
    scan = _Scan(2048)
    scan.add(_FakeStored({"source": {"file": "a.jsonl"}, "images": images}, [0, 1, 1, 0] + [1] * big + [0]))
    assert scan.image_token_runs == [2, big] and scan.sizes_are_source
    assert scan.sizes == {(100, 50): 1, (5000, 30): 1}
    assert scan.large == [{"tokens": big, "size": "5000x30", "file": "a.jsonl", "pixels_per_token": 784.0}]
    scan.add(_FakeStored({"source": {"file": "a.jsonl"}, "images": [{"width": 56, "height": 28}]}, [1, 1]))
    assert not scan.sizes_are_source and scan.sizes[(56, 28)] == 1
    # A dataset that records each image's unit (its span): those are the image's tokens, wrappers and all (Llama 4
    # marks one token of its ~150 as the image).
    scan = _Scan(2048)
    scan.add(
        _FakeStored(
            {
                "source": {"file": "a.jsonl"},
                "num_image_tokens": 7,
                "images": [{"width": 56, "height": 28, "span": [1, 6]}, {"width": 8, "height": 8, "span": [7, 9]}],
            },
            [0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        )
    )
    assert scan.image_token_runs == [5, 2] and scan.image_tokens == [7]


def test_stats_html_report_is_self_contained_with_a_chart_per_distribution(built, tmp_path):
    from html.parser import HTMLParser

    page = tmp_path / "sub" / "stats.html"
    res = CliRunner().invoke(app, ["stats", str(built), "--html", str(page)])
    assert res.exit_code == 0, res.output
    assert res.stdout.rstrip().endswith(f"wrote {page}")
    st = json.loads(CliRunner().invoke(app, ["stats", str(built), "--json"]).stdout)

    class Parsed(HTMLParser):
        def __init__(self):
            super().__init__()
            self.charts, self.bars, self.external, self.rows = [], 0, [], []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag in ("script", "link", "iframe", "object", "img") or any(
                (a.get(k) or "").startswith(("http", "//")) for k in ("src", "href")
            ):
                self.external.append(tag)
            if tag == "svg" and a.get("class") == "hist":
                self.charts.append((a["aria-label"], int(a["data-bins"])))
            self.bars += tag == "rect" and a.get("class") == "bar"

        def handle_data(self, data):
            self.rows.append(data)

    p = Parsed()
    html = page.read_text(encoding="utf-8")
    p.feed(html)
    assert p.external == [] and "Content-Security-Policy" in html
    labels = {
        "tokens_per_sample": "tokens per sample",
        "trained_tokens_per_sample": "trained tokens per sample",
        "images_per_sample": "images per sample",
        "tokens_per_image": "tokens per image",
    }
    assert p.charts == [(label, len(st[key]["histogram"])) for key, label in labels.items()]
    assert p.bars == sum(len(st[key]["histogram"]) for key in labels)
    assert "traces.jsonl" in p.rows and "bad.jsonl" in p.rows
    for w in st["warnings"]:
        assert w in p.rows


@pytest.mark.slow  # starts a browser: ~5 s alone, over 20 s beside other jobs on 2 cores
def test_stats_html_renders_in_headless_chromium(built, tmp_path):
    """The report opened by a real browser: a screenshot with the histogram bars' colour in it."""
    from PIL import Image

    from tests.vlmprep.tools.test_html_browser import run_chromium
    from vlmprep.tools.stats_report import BAR

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (tests/vlmprep/tools/test_html_browser.py installs it in make test-all)")
    page = tmp_path / "stats.html"
    assert CliRunner().invoke(app, ["stats", str(built), "--html", str(page)]).exit_code == 0
    shot = tmp_path / "shot.png"
    run_chromium(binary, tmp_path, f"--screenshot={shot}", page.as_uri())
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50, "the screenshot looks blank"
    bar = np.array([int(BAR[i : i + 2], 16) for i in (1, 3, 5)])
    assert int((np.abs(img - bar).max(axis=2) <= 3).sum()) > 5000, "no histogram bars in the screenshot"


# Beside the checkout in CI (as in tests/vlmprep/processors/test_vendors.py); VLMPREP_REAL_TRACES names another place.
REAL_TRACES = Path(
    os.environ.get("VLMPREP_REAL_TRACES", Path(__file__).resolve().parents[4] / "shared" / "data" / "real_traces")
)


@pytest.mark.slow  # a build of the 42 real records (~1 min on 2 cores) and two browser runs
def test_stats_on_the_real_traces_shows_what_each_file_loses(tmp_path):
    """On the public trajectories, under --long-traces truncate at 8192: OpenCUA's long traces lose most of their
    turns and WebVoyager few; stats names each file's coverage, the distributions and the warnings with their fixes
    (SeeAct's tall pages: --max-pixels), and both HTML reports render in headless Chromium (the stats charts; the
    sample page opens on the conversation, its 1.8k-token system prompt and tool list collapsed)."""
    from PIL import Image

    from tests.vlmprep.conftest import TOOLS
    from tests.vlmprep.tools.test_html_browser import run_chromium
    from vlmprep.tools.report import TRAINED_BG
    from vlmprep.tools.stats_report import BAR

    if not REAL_TRACES.is_dir():
        pytest.skip(f"{REAL_TRACES} is not here")
    out = tmp_path / "real"
    # Whatever the build's exit code (a coverage threshold may fail it), the dataset is written and stats reads it.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vlmprep",
            "build",
            "--in",
            str(REAL_TRACES),
            "--out",
            str(out),
            "--chat-template",
            TOOLS,
            "--long-traces",
            "truncate",
            "--no-progress",
        ],
        capture_output=True,
        timeout=1200,
    )
    res = CliRunner().invoke(app, ["stats", str(out), "--html", str(tmp_path / "stats.html")])
    assert res.exit_code == 0, res.output
    text = res.stdout.splitlines()
    st = json.loads(CliRunner().invoke(app, ["stats", str(out), "--json"]).stdout)
    files = {i["name"]: i for i in st["inputs"]}
    assert set(files) == {
        "llamafactory_mllm_demo.jsonl",
        "opencua.jsonl",
        "qwen25vl_cookbooks.jsonl",
        "seeact.jsonl",
        "webvoyager.jsonl",
    }
    opencua, webvoyager = files["opencua.jsonl"], files["webvoyager.jsonl"]
    assert opencua["coverage"] < 0.5 and opencua["truncated_samples"] == opencua["samples"] == 6
    assert webvoyager["coverage"] >= 0.95
    row = next(line.split() for line in text if line.strip().startswith("opencua.jsonl"))
    assert row[4:7] == [str(opencua["trained_assistant_turns"]), "of", str(opencua["input_assistant_turns"])]
    assert row[7] == f"{opencua['coverage']:.1%}"
    for label in ("tokens per sample", "trained tokens per sample", "images per sample", "tokens per image"):
        assert any(line.strip().startswith(label) for line in text), label
    assert any(line.startswith("image sizes (source WxH, images): 1024x768 ") for line in text)
    warnings = [line for line in text if line.startswith("WARNING: ")]
    assert any(w.startswith("WARNING: opencua.jsonl: ") for w in warnings)
    assert not any(w.startswith("WARNING: webvoyager.jsonl: ") for w in warnings)
    assert any("samples truncated" in w and "fix: " in w for w in warnings)
    assert any(" over 2048 tokens " in w and "--max-pixels 1605632" in w for w in warnings)
    seeact = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines() if "seeact" in line]
    assert any("1280x5808" in r["message"] and "--max-pixels" in r["message"] for r in seeact)

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed")
    shot = tmp_path / "stats.png"
    run_chromium(binary, tmp_path, f"--screenshot={shot}", (tmp_path / "stats.html").as_uri())
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    bar = np.array([int(BAR[i : i + 2], 16) for i in (1, 3, 5)])
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50 and (np.abs(img - bar).max(axis=2) <= 3).sum() > 5000
    # The first screen (1280x1000) of an OpenCUA sample shows trained text, not its system prompt.
    sample = tmp_path / "sample.html"
    first = next(line for line in (REAL_TRACES / "opencua.jsonl").read_text().splitlines() if line.strip())
    assert (
        CliRunner().invoke(app, ["inspect", str(out), "--id", json.loads(first)["id"], "--html", str(sample)]).exit_code
        == 0
    )
    shot = tmp_path / "sample.png"
    run_chromium(binary, tmp_path, "--window-size=1280,1000", f"--screenshot={shot}", sample.as_uri())
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)[:1000]
    green = np.array([int(TRAINED_BG[i : i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(img - green).max(axis=2) <= 3).sum() > 5000, "no trained text on the sample's first screen"


def test_many_input_files_list_the_lowest_coverage_first():
    from vlmprep.tools.stats import MAX_INPUT_ROWS
    from vlmprep.tools.stats_text import _input_lines

    inputs = [
        {
            **_input(f"part-{k:03d}.jsonl", 100 - k, 100),
            "path": f"/d/part-{k:03d}.jsonl",
            "records": 1,
            "images": 0,
            "tokens": 10,
            "trainable_tokens": 1,
        }
        for k in range(MAX_INPUT_ROWS + 5)
    ]
    lines = _input_lines({"inputs": inputs})
    assert lines[0] == (
        f"per input file ({MAX_INPUT_ROWS} of {MAX_INPUT_ROWS + 5}, lowest turn coverage first; --json lists all):"
    )
    assert [line.split()[0] for line in lines[2:]] == [f"part-{k:03d}.jsonl" for k in range(MAX_INPUT_ROWS + 4, 4, -1)]


def test_workers_read_shards_in_processes_and_give_the_same_stats(built):
    """--workers N scans shards in N forked processes and merges them in manifest order: the same numbers, the same
    lists (large images, per-input rows, warnings) and the same terminal text as one process."""
    from vlmprep.shards.manifest import load_manifest, shard_paths
    from vlmprep.shards.reader import iter_shard
    from vlmprep.tools.stats import _Scan, _scan_shard, compute_stats
    from vlmprep.tools.stats_text import format_stats

    n = len(list(built.glob("shard-*.tar")))
    assert n >= 2
    runs = {}
    for workers in (1, 2, 3):
        seen = []
        runs[workers] = compute_stats(
            built, workers=workers, on_shard=lambda done, total, seen=seen: seen.append((done, total))
        )
        assert seen == [(k, n) for k in range(1, n + 1)]
    assert runs[1] == runs[2] == runs[3] and format_stats(runs[1]) == format_stats(runs[3])
    assert runs[1]["samples"] > n and runs[1]["truncated_samples"] and runs[1]["dropped_images"]
    # the merge of per-shard scans is the one scan of every shard: each field, not only what the report shows
    manifest = load_manifest(built)
    paths, limit = shard_paths(built, manifest), 8  # a low limit: every image is "large", so that list is filled
    one, merged = _Scan(limit, rows=True), _Scan(limit, rows=True)  # the sample rows (--samples) too
    for k in range(n):
        part = _scan_shard((paths, manifest.format_version, limit, True), k)
        merged.merge(part)
    for p in paths:
        for ts in iter_shard(p, version=manifest.format_version):
            one.add(ts)
    assert one.large and one.by_file and one.sizes and len(one.rows["id"]) == runs[1]["samples"]
    assert vars(one) == vars(merged)
    cli = [CliRunner().invoke(app, ["stats", str(built), "--json", "--workers", w]) for w in ("1", "2")]
    assert cli[0].exit_code == cli[1].exit_code == 0 and cli[0].stdout == cli[1].stdout


def test_samples_and_rejects_tables_load_in_pandas_and_add_up_to_the_manifest(built, tmp_path):
    """`stats --samples / --rejects`: one Parquet row per sample and per reject, read back with pandas; counts and
    sums equal the manifest's and the tars' own (recompute), rows in manifest order; the same bytes for any --workers."""
    pd = pytest.importorskip("pandas")
    manifest = json.loads((built / "manifest.json").read_text())
    tables = {}
    for w in (1, 2):
        s, r = tmp_path / f"samples-{w}.parquet", tmp_path / f"rejects-{w}.parquet"
        res = CliRunner().invoke(
            app, ["stats", str(built), "--samples", str(s), "--rejects", str(r), "--workers", str(w)]
        )
        assert res.exit_code == 0, res.output
        assert f"wrote {s} ({manifest['totals']['samples']} samples)" in res.output
        tables[w] = s.read_bytes(), r.read_bytes()
    assert tables[1] == tables[2]
    samples = pd.read_parquet(tmp_path / "samples-1.parquet")
    rejects = pd.read_parquet(tmp_path / "rejects-1.parquet")
    t = manifest["totals"]
    assert len(samples) == t["samples"] and int(samples["tokens"].sum()) == t["tokens"]
    assert int(samples["trained_tokens"].sum()) == t["trainable_tokens"]
    assert int(samples["images"].sum()) == t["images"] and int(samples["truncated"].sum()) == t["truncated_samples"]
    per, truncated, _, by_reason = recompute(built)
    assert (
        samples["tokens"].tolist() == per["tokens"].tolist()
        and samples["trained_tokens"].tolist() == per["trained"].tolist()
        and int(samples["truncated"].sum()) == truncated
    )
    shards = [s["name"] for s in manifest["shards"]]
    assert samples["shard"].tolist() == [n for n, s in zip(shards, manifest["shards"]) for _ in range(s["num_samples"])]
    assert samples.groupby("shard")["shard_index"].apply(list).tolist() == [
        list(range(s["num_samples"])) for s in manifest["shards"]
    ]
    assert rejects["reason"].value_counts().to_dict() == manifest["rejects"] == by_reason
    assert set(rejects["source_file"]) == {str(built.parent / "bad.jsonl")} and rejects["source_line"].tolist() == [
        1,
        2,
        3,
    ]


def test_stats_show_images_per_storage_and_their_bytes_against_the_sources(tmp_path, qwen2vl_processor):
    """The default --image-format auto stores a JPEG photo as its bytes and a PNG screenshot as zstd-pdelta pixels:
    stats counts the stored images of each storage (an image repeated in a sample once), their bytes (the tar
    members') and those over their sources' bytes (the meta's source_bytes), in JSON and as one line of text."""
    import base64

    from tests.vlmprep.test_images import asymmetric_rgb, photo, save

    jpeg, png = save(photo(300, 200), "JPEG", quality=90), save(asymmetric_rgb(320, 200))

    def part(data, kind):
        return {
            "type": "image_url",
            "image_url": {"url": f"data:image/{kind};base64," + base64.b64encode(data).decode()},
        }

    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    part(jpeg, "jpeg"),
                    part(png, "png"),
                    part(jpeg, "jpeg"),
                    {"type": "text", "text": "Same?"},
                ],
            },
            {"role": "assistant", "content": "The first and the last are one photo."},
        ]
    }
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    build(BuildConfig(inputs=(str(tmp_path / "in.jsonl"),), out=str(tmp_path / "ds"), progress=False))
    with tarfile.open(tmp_path / "ds" / "shard-000000.tar") as tf:
        sizes = {m.name.split(".", 1)[1]: m.size for m in tf}
    res = CliRunner().invoke(app, ["stats", str(tmp_path / "ds"), "--json"])
    st = json.loads(res.output)
    assert st["image_storage"] == {
        "original": {"images": 1, "bytes": len(jpeg), "source_bytes": len(jpeg), "unknown": 0},
        "zstd-pdelta": {"images": 1, "bytes": sizes["img001.pdelta.zst"], "source_bytes": len(png), "unknown": 0},
    }
    text = CliRunner().invoke(app, ["stats", str(tmp_path / "ds")]).output
    ratio = sizes["img001.pdelta.zst"] / len(png)
    line = f"image storage      original 1 ({len(jpeg) / 1e3:.1f} kB, 1.00x their source) | zstd-pdelta 1 ("
    assert line in text and f"{ratio:.2f}x their source)" in text, text
