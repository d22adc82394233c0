"""A URL dataset's server is untrusted (docs/scale.md): small files are read as a stream that stops at their limit
whatever the server sends, a .part is refetched where the server answers no range read, and a silent or dripping
server ends in one line naming --read-timeout, never a hang."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.range_server import RangeServer
from tests.trainer.conftest import ROOT
from trainer.data import storage
from trainer.data.errors import DataError
from trainer.data.sources import resolve_data
from trainer.data.storage import StorageError, fetch, read_url

LIMIT = 1 << 20


@pytest.fixture
def served(tmp_path) -> Path:
    root = tmp_path / "served"
    root.mkdir()
    (root / "big.json").write_bytes(b"[" * (8 * LIMIT))
    return root


@pytest.mark.parametrize("how", ["endless", "gzip", "no_ranges"])
def test_a_small_remote_file_is_read_no_further_than_its_limit(served, how):
    """Endless body, a 100 MB gzip body of ~100 KB on the wire, a server that ignores Range and sends the whole
    8 MB file: each read stops one byte past the limit and is refused, and the server sent little more."""
    with RangeServer(served) as srv:
        if how == "endless":
            srv.server.endless.add("big.json")
        elif how == "gzip":
            srv.server.gzip["big.json"] = 100 * LIMIT
        else:
            srv.server.no_ranges = True
        with pytest.raises(StorageError, match=rf"big.json is more than {LIMIT} bytes, more than a reader accepts"):
            read_url(f"{srv.url}/big.json", LIMIT)
        time.sleep(0.2)
        sent = srv.server.sent
    if how == "endless":
        assert sent < 32 * LIMIT, sent  # socket buffers' worth past the limit, not gigabytes


# VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so the child would report the pytest worker's peak.
_CHILD = """
import sys
from trainer.data.sources import DataError, resolve_data
try:
    resolve_data(sys.argv[1])
    print("no error")
except DataError as e:
    print(str(e))
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) // 1024)
"""


def test_an_endless_manifest_is_one_line_in_bounded_memory(served):
    """The trainer's start-up on a dataset URL whose manifest.json never ends: refused past the manifest limit
    (256 MiB), the process's peak memory about that, not the gigabytes the server would go on sending."""
    with RangeServer(served) as srv:
        srv.server.endless.add("manifest.json")
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, srv.url + "/"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    line, peak_mb = r.stdout.strip().splitlines()
    assert line.endswith("manifest.json is more than 268435456 bytes, more than a reader accepts"), r.stdout + r.stderr
    assert int(peak_mb) < 900, peak_mb


def test_a_part_from_a_server_without_range_reads_is_fetched_again(dataset, tmp_path):
    """A kill left SHARD.part; the server answers every GET with the whole file: the fetch starts over (before, every
    restart failed with fsspec's "doesn't appear to support range requests")."""
    shard = resolve_data(str(dataset)).shards[1]
    dest = tmp_path / "copy.tar"
    Path(str(dest) + ".part").write_bytes(Path(shard.url).read_bytes()[:50_000])
    with RangeServer(dataset) as srv:
        srv.server.no_ranges = True
        fetch(f"{srv.url}/{shard.name}", dest, size=shard.num_bytes, sha256=shard.sha256)
    assert dest.read_bytes() == Path(shard.url).read_bytes() and not Path(str(dest) + ".part").exists()


@pytest.mark.parametrize("how", ["drip", "silent"])
def test_a_stalled_server_ends_in_one_line_naming_read_timeout(dataset, tmp_path, monkeypatch, how):
    monkeypatch.setattr(storage, "READ_TIMEOUT_S", 0.5)
    shard = resolve_data(str(dataset)).shards[0]
    with RangeServer(dataset) as srv:
        getattr(srv.server, how).add(shard.name)
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            fetch(f"{srv.url}/{shard.name}", tmp_path / "s.tar", size=shard.num_bytes, sha256=shard.sha256)
        took = time.monotonic() - t0
        with pytest.raises(StorageError, match="--read-timeout 0.5 s"):
            read_url(f"{srv.url}/{shard.name}", LIMIT)
    assert "\n" not in str(e.value) and "--read-timeout 0.5 s" in str(e.value), str(e.value)
    assert took < 8  # the server would go on for minutes (silent: 10 s; drip: forever)


def test_read_timeout_is_an_option_the_run_uses(tmp_path):
    from trainer.cli import parse_args
    from trainer.config import ConfigError

    assert (
        parse_args(
            ["--data", "d", "--out", str(tmp_path), "--tiny-random", "qwen2-vl", "--read-timeout", "5"]
        ).read_timeout
        == 5.0
    )
    with pytest.raises(ConfigError, match="read_timeout=0.0: seconds, > 0"):
        parse_args(["--data", "d", "--out", str(tmp_path), "--tiny-random", "qwen2-vl", "--read-timeout", "0"])


def test_bad_json_from_a_url_dataset_is_one_line(served):
    with RangeServer(served) as srv:
        (served / "manifest.json").write_text("{not json")
        with pytest.raises(DataError) as e:
            resolve_data(srv.url + "/")
    assert "\n" not in str(e.value) and "manifest.json" in str(e.value)
    json.dumps(str(e.value))


def test_a_redirect_out_of_http_or_in_a_loop_says_so(served):
    """fsspec's HTTP calls every failed open "no such file"; a redirect to file:// or a loop is named as one."""
    with RangeServer(served) as srv:
        srv.server.redirect["manifest.json"] = "file:///etc/passwd"
        srv.server.redirect["loop.json"] = f"{srv.url}/loop.json"
        with pytest.raises(DataError) as e:
            resolve_data(srv.url + "/")
        with pytest.raises(StorageError) as loop:
            read_url(f"{srv.url}/loop.json", LIMIT)
    assert str(e.value) == (
        f"cannot open {srv.url}/manifest.json: the server redirects it to file:///etc/passwd, "
        "which is not an http(s) URL; refusing to follow it"
    )
    assert str(loop.value).endswith("the server redirects it in a loop (or more than 10 times)")


def test_credentials_in_eval_data_are_named_as_eval_data(dataset, tmp_path, capsys):
    from trainer.train import main

    assert (
        main(
            [
                "--data",
                str(dataset),
                "--eval-data",
                "http://user:hunter2@127.0.0.1:9/ds/",
                "--out",
                str(tmp_path / "run"),
                "--tiny-random",
                "qwen2-vl",
                "--max-steps",
                "1",
                "--num-workers",
                "0",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "trainer: error: --eval-data: a http:// URL with credentials in it" in err and "hunter2" not in err, err
