import io
import json
import shutil
import tarfile

import numpy as np
import pytest
from typer.testing import CliRunner

from vlmprep.build.pipeline import build
from vlmprep.cli import app
from vlmprep.config import BuildConfig


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from scripts.demo_traces import generate_traces

    d = tmp_path_factory.mktemp("stats")
    recs = list(generate_traces(n=6, seed=1, min_images=1, max_images=3, width=320, height=200,
                                overlong_fraction=0.2, text_only_fraction=0.1))
    no_answer = {"messages": [{"role": "user", "content": "hi"}]}
    lines = [json.dumps(r) for r in recs] + ["[1, 2]", "{broken", json.dumps(no_answer)]
    inp = d / "traces.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = d / "shards"
    build(BuildConfig(inputs=(str(inp),), out=str(out), seq_len=1024, samples_per_shard=3,
                      tool_calls="train-content", progress=False, max_reject_fraction=1.0,  # bad lines on purpose,
                      long_traces="truncate", min_turn_coverage=0.0))  # and truncated samples
    return out


def recompute(out):
    """Totals straight from the tars with tarfile + np.load, independent of vlmprep's reader."""
    tokens, trained, image_tokens, images, truncated, dropped = [], 0, 0, [], 0, 0
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                data = tf.extractfile(m).read()
                if ext == "loss_mask.npy":
                    mask = np.load(io.BytesIO(data))
                    tokens.append(len(mask))
                    trained += int(mask.sum())
                elif ext == "mm_token_type_ids.npy":
                    image_tokens += int(np.load(io.BytesIO(data)).sum())
                elif ext == "image_grid_thw.npy":
                    images.append(len(np.load(io.BytesIO(data))))
                elif ext == "json":
                    meta = json.loads(data)
                    truncated += meta["truncated"]
                    dropped += meta["dropped_images"]
    rejects = {}
    for line in (out / "rejects.jsonl").read_text().splitlines():
        r = json.loads(line)["reason"]
        rejects[r] = rejects.get(r, 0) + 1
    return np.array(tokens), trained, image_tokens, np.array(images), truncated, dropped, rejects


def test_stats_equal_totals_recomputed_from_shards(built):
    tokens, trained, image_tokens, images, truncated, dropped, rejects = recompute(built)
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
    srt = np.sort(tokens)
    for q in (50, 90, 99):  # nearest rank
        assert tps[f"p{q}"] == srt[int(np.ceil(q / 100 * len(srt))) - 1]
    assert tps["max"] == tokens.max() and tps["min"] == tokens.min()
    hist = st["tokens_histogram"]
    assert sum(b["count"] for b in hist) == len(tokens)
    assert all(sum(b["lo"] <= t < b["hi"] for t in tokens) == b["count"] for b in hist)
    assert st["mismatches"] == []

    text = CliRunner().invoke(app, ["stats", str(built)]).stdout
    assert f"records            {st['records']} read, {len(tokens)} samples, {st['rejected']} rejected" in text
    assert f"tokens             {tokens.sum()} | trained {trained} ({trained / tokens.sum():.1%})" in text
    assert f"| p50 {tps['p50']} | p90 {tps['p90']} | p99 {tps['p99']} | max {tokens.max()}" in text
    assert f"truncated          {truncated} sample{'s' * (truncated != 1)} (" in text
    assert f"{dropped} image{'s' * (dropped != 1)} dropped by the cut" in text
    for reason, n in rejects.items():
        assert any(line.split() == [reason, str(n)] for line in text.splitlines())
    assert "tokens per sample histogram:" in text and "#" in text
    # No mismatch; the one warning is the truncated turns' (the build accepted them with --min-turn-coverage 0).
    assert [ln for ln in text.splitlines() if "WARNING" in ln] == [f"WARNING: {st['coverage_warning']}"]
    assert st["coverage_warning"].startswith("turn coverage 92.3% < --min-turn-coverage 0.95 (12 of 13 assistant ")


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
