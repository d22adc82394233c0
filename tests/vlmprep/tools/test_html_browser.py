"""The HTML report opened in a real browser: headless Chromium takes a screenshot and dumps the DOM."""

import io
import json
import os
import shutil
import subprocess
import tarfile
from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from vlmprep.builder.pipeline import build
from vlmprep.cli import app
from vlmprep.config import BuildConfig
from vlmprep.tools.report import TRAINED_BG

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
]
WINDOW = (1280, 2000)


def chromium():
    """The chromium binary, installed with apt when missing and possible; otherwise skip with the reason."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if not shutil.which("apt-get"):
        pytest.skip("chromium is not installed and apt-get is unavailable to install it")
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and installing it with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.skip(f"chromium could not be installed: {' '.join(cmd)} failed: {r.stderr.strip()[-300:]}")
    path = shutil.which("chromium")
    if not path:
        pytest.skip("apt-get installed chromium but no chromium binary is on PATH")
    return path


def run_chromium(binary, tmp_path, *args):
    profile = tmp_path / "chromium-profile"
    cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from scripts.demo_traces import write_traces

    d = tmp_path_factory.mktemp("html")
    inp = d / "traces.jsonl.zst"
    write_traces(
        inp,
        n=3,
        seed=1,
        min_images=1,
        max_images=2,
        width=320,
        height=200,
        overlong_fraction=0.0,
        text_only_fraction=0.0,
    )
    out = d / "shards"
    build(BuildConfig(inputs=(str(inp),), out=str(out), seq_len=1024, tool_calls="train-content", progress=False))
    page = d / "report.html"
    res = CliRunner().invoke(app, ["inspect", str(out), "--limit", "3", "--html", str(page)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"wrote {page}: 3 samples, 0 rejects"
    return out, page


def shard_samples(out):
    samples = {}
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                if ext in ("loss_mask.npy", "mm_token_type_ids.npy"):
                    samples.setdefault(key, {})[ext.split(".")[0]] = np.load(io.BytesIO(tf.extractfile(m).read()))
                elif ext == "json":
                    samples.setdefault(key, {})["meta"] = json.loads(tf.extractfile(m).read())
    return samples


def n_runs(flags):
    f = np.concatenate([[0], np.asarray(flags, dtype=np.int8)])
    return int((np.diff(f) == 1).sum())


class DomCounts(HTMLParser):
    """Per sample section: trained-run spans, image markers, thumbnails, hoverable tokens."""

    def __init__(self):
        super().__init__()
        self.key = None
        self.counts = {}
        self.network = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for attr in ("src", "href"):
            v = a.get(attr) or ""
            if v and not v.startswith(("data:", "#")):
                self.network.append(v)
        if tag in ("script", "link", "iframe", "object"):
            self.network.append(tag)
        if tag == "section" and "data-key" in a:
            self.key = a["data-key"]
            self.counts[self.key] = {"tr": 0, "im": 0, "img": 0, "tok": 0, "titles": []}
        if self.key is None:
            return
        c = self.counts[self.key]
        cls = a.get("class")
        if tag == "span" and cls in ("tr", "im"):
            c[cls] += 1
        if tag == "span" and cls in ("k", "k sp"):
            c["tok"] += 1
            c["titles"].append(a.get("title", ""))
        if tag == "img" and (a.get("src") or "").startswith("data:image/png;base64,"):
            c["img"] += 1


@pytest.mark.slow  # starts a browser
def test_report_renders_in_headless_chromium(report, tmp_path):
    out, page = report
    binary = chromium()
    html = page.read_text(encoding="utf-8")
    shot = tmp_path / "shot.png"
    run_chromium(binary, tmp_path, f"--screenshot={shot}", page.as_uri())
    dom = run_chromium(binary, tmp_path, "--dump-dom", page.as_uri())

    # Screenshot: a real rendering, with the trained-span green covering more than the legend swatch.
    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[:2] == (WINDOW[1], WINDOW[0])
    colours = np.unique(img.reshape(-1, 3), axis=0)
    assert len(colours) > 50, f"screenshot looks blank: {len(colours)} colours"
    green = np.array([int(TRAINED_BG[i : i + 2], 16) for i in (1, 3, 5)])
    n_green = int((np.abs(img.astype(int) - green).max(axis=2) <= 3).sum())
    assert n_green > 5000, f"only {n_green} trained-green pixels"

    # DOM after the browser parsed it: the trained runs and image markers of every sample are there.
    assert "<section" in dom and len(dom) > 0.5 * len(html)
    parsed = DomCounts()
    parsed.feed(dom)
    assert parsed.network == []
    ref = shard_samples(out)
    assert sorted(parsed.counts) == sorted(ref)
    for key, s in ref.items():
        c = parsed.counts[key]
        n_images = s["meta"]["num_images"]
        assert c["tr"] == n_runs(s["loss_mask"] == 1), key
        assert c["im"] == n_runs(s["mm_token_type_ids"] == 1) == n_images
        assert c["img"] == n_images
        # every text token is hoverable, outside the images' whole units (their spans take the wrapper tokens too)
        in_image = s["mm_token_type_ids"] != 0
        for im in s["meta"].get("images") or []:
            if im.get("span"):
                in_image[im["span"][0] : im["span"][1]] = True
        assert c["tok"] == int((~in_image).sum())
        assert all(t.startswith("#") and " id " in t and " mask " in t and " type " in t for t in c["titles"])
    assert "[image 1: " in dom and "patches -&gt; " in dom
