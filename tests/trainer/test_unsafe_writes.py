"""Where the trainer and the build write (run dir, rank cache dirs, shared index dir, build output), nothing planted
there is written through, a lock another process holds is waited for with a limit that names it, and a full disk is
one line the readers see (docs/untrusted-datasets.md, "Where vlmprep writes")."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import ROOT
from trainer.config import ConfigError, DataSpec
from trainer.data.errors import DataError
from trainer.data.sources import plan_shards, resolve_data


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of the user's that a planted symlink points at: it must keep its bytes."""
    p = tmp_path / "victim.txt"
    p.write_text("the user's own file\n")
    return p


def test_a_symlinked_part_file_in_the_cache_is_refused_and_its_target_kept(dataset, tmp_path, victim):
    """Anyone who can write the shared cache dir could plant SHARD.part -> ~/.bashrc: the fetch would append the
    shard's bytes to it. The fetch refuses it in one line and writes nothing through it."""
    import fsspec

    from trainer.data.storage import StorageError, fetch

    shard = resolve_data(str(dataset)).shards[0]
    fsspec.filesystem("memory").pipe("memory://planted/s.tar", Path(shard.url).read_bytes())
    dest = tmp_path / "cache" / "s.tar"
    dest.parent.mkdir()
    Path(str(dest) + ".part").symlink_to(victim)
    with pytest.raises(StorageError, match=r"s\.tar\.part is a symlink or special file .* refusing to write through"):
        fetch("memory://planted/s.tar", dest, size=shard.num_bytes, sha256=shard.sha256)
    assert victim.read_text() == "the user's own file\n" and not dest.exists()
    os.unlink(str(dest) + ".part")
    fetch("memory://planted/s.tar", dest, size=shard.num_bytes, sha256=shard.sha256)  # the plain case still works
    assert dest.read_bytes() == Path(shard.url).read_bytes()


def test_a_fifo_where_a_file_is_written_is_refused_not_waited_on(tmp_path):
    from vlmprep_schemas.boundary import UnsafeWrite, open_no_follow

    os.mkfifo(tmp_path / "f")
    with pytest.raises(UnsafeWrite, match="symlink or special file"):
        open_no_follow(tmp_path / "f", "wb")  # no reader: would block forever without O_NONBLOCK
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        open_no_follow(tmp_path / "d", "ab")


def test_a_symlinked_run_lock_metrics_or_config_is_refused(tmp_path, victim):
    from trainer.checkpoint import RUN_LOCK, own_run_dir
    from trainer.metrics import RunLog

    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_LOCK).symlink_to(victim)
    with pytest.raises(ConfigError, match=rf"{RUN_LOCK} is a symlink or special file"):
        with own_run_dir(run):
            pass
    (run / RUN_LOCK).unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    from vlmprep_schemas.boundary import UnsafeWrite

    with pytest.raises(UnsafeWrite, match="metrics.jsonl is a symlink"):
        RunLog(run, total_steps=1, start_step=0, progress=False, tensorboard=False, log_every=0)
    assert victim.read_text() == "the user's own file\n"


@pytest.mark.slow  # ~12 s, a trainer process: make test keeps the refusals in process (the test above)
def test_the_trainer_reports_a_planted_link_in_its_run_dir_in_one_line(dataset, tmp_path, victim):
    from tests.trainer.conftest import trainer_cmd, trainer_env

    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").symlink_to(victim)
    r = subprocess.run(
        trainer_cmd(["--data", dataset, "--out", out, "--max-steps", 1], 1),
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("trainer: error")]
    assert len(lines) == 1 and "train.log is a symlink or special file" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and victim.read_text() == "the user's own file\n"


_HOLD = """
import sys, time
from pathlib import Path
from trainer import locks
fd, who = locks.take(Path(sys.argv[1]))
assert fd >= 0, who
print("held", flush=True)
time.sleep(60)
"""


def test_a_lock_held_by_another_process_is_waited_for_then_refused_naming_it(tmp_path):
    """A stuck rank of another job holds the node's shared index lock: the wait says who after a while and ends
    with a TimeoutError naming the holder's pid and command, not a hang."""
    from trainer import locks

    lock = tmp_path / "indexes" / "x.npy.lock"
    lock.parent.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(lock)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert p.stdout.readline().strip() == "held"
        said = []
        with pytest.raises(TimeoutError, match=rf"x\.npy\.lock \(the index\) has been held for \d+ s by pid {p.pid} "):
            locks.wait_for(lock, "the index", say=said.append, wait_s=0.6)
        assert len(said) == 1 and f"held by pid {p.pid}" in said[0]
    finally:
        p.kill()
        p.wait()
    fd = locks.wait_for(lock, "the index", wait_s=5)  # the holder died: its flock went with it
    assert fd >= 0
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    locks.release(lock, fd)


def test_the_shared_index_lock_wait_is_a_data_error(dataset, tmp_path, monkeypatch):
    """The same through the trainer's path: the rank that waits past the limit stops with a DataError."""
    from trainer import locks
    from trainer.data.remote_index import SHARED_INDEXES, cache_name, fetched_shared
    from trainer.data.sources import IndexRef

    ref = IndexRef(url="memory://held/samples.index.npy", num_bytes=10, sha256="0" * 64)
    cache = tmp_path / "shard-cache" / "rank-00000"
    local = cache.parent / SHARED_INDEXES / cache_name(f"{ref.url}#{ref.sha256}", ref.url)
    local.parent.mkdir(parents=True)
    lock = local.with_name(local.name + ".lock")
    fd, _ = locks.take(lock)  # another open file description: flock refuses it as it refuses another process
    monkeypatch.setattr(locks, "WAIT_S", 0.3)
    try:
        with pytest.raises(DataError, match=r"has been held for \d+ s by pid"):
            fetched_shared(ref, cache)
    finally:
        locks.release(lock, fd)


def test_two_runs_on_one_shard_cache_dir_are_refused(dataset, tmp_path):
    """Two trainers with the same --shard-cache would continue each other's .part files and evict each other's
    shards: the second is refused naming the first; once the first ends, the dir is free."""
    from trainer.data.cache import ShardCache
    from trainer.data.order import schedule
    from trainer.data.pipeline import rank_sources

    ds = resolve_data(str(dataset))
    sources = rank_sources(
        (DataSpec(path=str(dataset)),), [ds], [plan_shards(ds.shards, 1)], rank=0, world=1, cache=tmp_path / "c"
    )[0]
    order = schedule(sources, seed=1, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1)
    first, second = ShardCache(sources, tmp_path / "c"), ShardCache(sources, tmp_path / "c")
    first.begin(order, 0, 0)
    try:
        first.begin(order, 0, 0)  # the same run's next epoch keeps its dir
        with pytest.raises(DataError, match=r"c is in use by another trainer \(pid \d+ .*pass another --shard-cache"):
            second.begin(order, 0, 0)
    finally:
        first.end()
    second.begin(order, 0, 0)
    second.end()


def test_a_full_disk_fails_the_fetch_in_one_line_that_the_readers_see(dataset, image_spec, tmp_path, monkeypatch):
    """The cache's disk fills mid-fetch: the fetcher's line names the cache dir and the way out, and reaches the
    reader through shared memory (writing it to a file on the full disk would fail too)."""
    import fsspec

    import trainer.data.storage as storage
    from trainer.data.cache import ShardCache
    from trainer.data.order import schedule
    from trainer.data.pipeline import rank_sources
    from trainer.data.streams import ScheduledStream

    fs = fsspec.filesystem("memory")
    for p in dataset.rglob("*"):
        if p.is_file() and "tasks" not in p.parts:
            fs.pipe(f"memory://full/{p.relative_to(dataset)}", p.read_bytes())
    ds = resolve_data("memory://full")
    sources = rank_sources(
        (DataSpec(path="memory://full"),), [ds], [plan_shards(ds.shards, 1)], rank=0, world=1, cache=tmp_path / "c"
    )[0]
    real = storage.open_no_follow

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(storage, "open_no_follow", lambda path, mode: Full(real(path, mode)))
    order = schedule(sources, seed=1, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1)
    cache = ShardCache(sources, tmp_path / "c", prefetch=1)
    cache.begin(order, 0, 0)
    try:
        with pytest.raises(DataError) as e:
            for _ in ScheduledStream(sources, order, start=0, spec=image_spec, cache=cache.view):
                pass
    finally:
        cache.end()
    line = str(e.value)
    assert "\n" not in line and line.startswith("cannot fetch memory://full/shard-")
    assert f"into {tmp_path / 'c'}: no space left there" in line and "--shard-cache-limit" in line
    assert not list((tmp_path / "c").glob("errors")), "nothing is written to the full disk to report it"


def _in_a_tmpfs(cache: Path, size: int) -> list[str] | None:
    """A command prefix that runs its command with a real tmpfs of `size` bytes mounted at `cache`, in a private
    mount namespace (as an unprivileged user where user namespaces are allowed; as root otherwise); None where
    this machine allows neither."""
    import shutil

    if not shutil.which("unshare"):
        return None
    prefix = ["unshare", "-Urm", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"', str(cache)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else None


@pytest.mark.slow  # a trainer start-up over loopback HTTP in its own mount namespace: ~50 s on 2 cores
def test_a_real_full_tmpfs_cache_ends_the_run_in_one_line(dataset, tmp_path):
    """The shard cache on a real tmpfs smaller than a shard (the kernel's ENOSPC, not a patched write): the run
    exits 1 within a minute, its last line names the cache dir and the way out, and no traceback is printed;
    before, the cache thread died with a traceback and the readers waited forever."""
    from tests.support.range_server import RangeServer
    from tests.trainer.conftest import trainer_cmd, trainer_env

    shards = json.loads((dataset / "manifest.json").read_text())["shards"]
    size = min(s["bytes"] for s in shards) // 2 // 4096 * 4096  # the indexes fit; no shard does
    cache = tmp_path / "cache"
    cache.mkdir()
    prefix = _in_a_tmpfs(cache, size)
    if prefix is None:
        pytest.skip("this machine lets no process mount a tmpfs (neither user namespaces nor root)")
    with RangeServer(dataset) as srv:
        cmd = trainer_cmd(["--data", f"{srv.url}/", "--out", tmp_path / "run", "--shard-cache", cache], 1)
        r = subprocess.run([*prefix, *cmd], cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=240)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"into {cache}" in last and "no space left there" in last and "--shard-cache-limit" in last, last


def test_a_build_never_writes_through_a_link_planted_in_its_output(tmp_path, victim, traces):
    """A planted DIR/.vlmprep.lock or shard temp file: the build refuses in one line (the lock) or removes the
    link before writing its own file (a stale temp file); the target keeps its bytes either way."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    out = tmp_path / "ds"
    out.mkdir()
    (out / ".vlmprep.lock").symlink_to(victim)
    args = [
        "build",
        "--in",
        str(traces),
        "--out",
        str(out),
        "--processor",
        "builtin:qwen2-vl",
        "--seq-len",
        "2048",
        "--tool-calls",
        "train-content",
        "--no-progress",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and ".vlmprep.lock is a symlink or special file" in r.output, r.output
    (out / ".vlmprep.lock").unlink()
    (out / "shard-000000.tar.tmp").symlink_to(victim)  # stale temp files of the build's own names: removed first
    (out / "manifest.json.tmp").symlink_to(victim)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and victim.read_text() == "the user's own file\n", r.output
    assert (out / "shard-000000.tar").is_file() and not (out / "shard-000000.tar").is_symlink()
    assert not list(out.glob("*.tmp"))


def test_every_atomic_write_of_the_build_refuses_a_link_at_its_temp_name(tmp_path, victim):
    """A link that appears after the build cleaned its dir (or in one it resumes) is refused where it is met: the
    atomic writes (manifest, rejects, processor files) and the shard writer's temp file."""
    from vlmprep.shards.dataset import write_json_atomic
    from vlmprep.shards.writer import ShardWriter
    from vlmprep_schemas.boundary import UnsafeWrite

    (tmp_path / "manifest.json.tmp").symlink_to(victim)
    with pytest.raises(UnsafeWrite, match="manifest.json.tmp is a symlink"):
        write_json_atomic(tmp_path / "manifest.json", {"a": 1})
    (tmp_path / "shard-000000.tar.tmp").symlink_to(victim)
    with pytest.raises(UnsafeWrite, match=r"shard-000000\.tar\.tmp is a symlink"):
        ShardWriter(tmp_path, samples_per_shard=2, shard_size_bytes=1 << 20)._open()
    assert victim.read_text() == "the user's own file\n" and not (tmp_path / "manifest.json").exists()


# --- round 5 (issue 53.6): the dirs themselves, and the state files read back, never through a link or a FIFO


def test_a_linked_run_dir_is_refused_and_its_target_kept(tmp_path):
    """--out itself a link (planted at the name before the run made it): refused in one line, nothing written in
    the target. Before: the lock, run.json and the checkpoints went into the link's target."""
    from tests.support.planted import plant, untouched, victim_dir
    from trainer.checkpoint import own_run_dir

    victim = victim_dir(tmp_path)
    plant(tmp_path / "run", "symlink", victim)
    with pytest.raises(ConfigError, match=r"run is a symlink to .*victim where vlmprep keeps a dir of its own"):
        with own_run_dir(tmp_path / "run"):
            pass
    assert untouched(victim)


def test_a_linked_checkpoint_temp_dir_is_removed_not_written_through(tmp_path):
    """RUN/checkpoints/step-N.tmp planted as a link to a dir of the user's: the link goes, the checkpoint is written
    in a dir of its own. Before: rmtree refused the link silently and the save failed with a FileExistsError."""
    import warnings

    from tests.support.planted import plant, untouched, victim_dir
    from trainer.checkpoint import TrainState, checkpoint_problem, save_checkpoint

    victim = victim_dir(tmp_path)
    plant(tmp_path / "run" / "checkpoints" / "step-00000001.tmp", "symlink", victim)
    net = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        final = save_checkpoint(
            tmp_path / "run",
            TrainState(step=1, epoch=0, position=0, pack_state=[]),
            net=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            device=torch.device("cpu"),
            keep_checkpoints=1,
        )
    assert checkpoint_problem(final) is None and not final.is_symlink() and untouched(victim)


@pytest.mark.parametrize("name", ["run.json", "lock note", "shard record", "metrics for plot"])
def test_a_fifo_at_a_state_file_the_trainer_reads_back_is_not_waited_on(tmp_path, name):
    """A FIFO at run.json (read to check a resume), a lock's note, the rank's record of hashed shards or the
    metrics `trainer plot` reads: refused or skipped at once, never waited on (before: each read hung)."""
    from tests.support.planted import finishes, plant
    from trainer import locks
    from trainer.checkpoint import check_resumable
    from trainer.data.integrity import RECORD, ShardCheck

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / "x.distcp").write_bytes(b"x")
    if name == "run.json":
        plant(run / "run.json", "FIFO")
        with pytest.raises(ConfigError, match=r"run\.json is a symlink or special file"):
            finishes(lambda: check_resumable(run, {}, "data"), timeout_s=20)
    elif name == "lock note":
        plant(run / "trainer.lock", "FIFO")
        assert finishes(lambda: locks.holder(run / "trainer.lock"), timeout_s=20) == "another process"
    elif name == "metrics for plot":
        from trainer.plot import read_records

        plant(run / "metrics.jsonl", "FIFO")
        with pytest.raises(ConfigError, match=r"metrics\.jsonl is a symlink or special file"):
            finishes(lambda: read_records(run), timeout_s=20)
    else:
        plant(run / "shard-cache" / "rank-00000" / RECORD, "FIFO")
        assert finishes(lambda: ShardCheck(run / "shard-cache" / "rank-00000" / RECORD).known, timeout_s=20) == {}


@pytest.mark.parametrize("where", ["rank dir", "indexes dir"])
def test_a_linked_shard_cache_dir_is_refused(dataset, tmp_path, where):
    """--shard-cache/rank-NNNNN or the node's shared indexes/ planted as a link: a DataError naming it, nothing
    fetched into or evicted from the target."""
    from tests.support.planted import plant, untouched, victim_dir
    from trainer.data.cache import ShardCache
    from trainer.data.order import schedule
    from trainer.data.pipeline import rank_sources
    from trainer.data.remote_index import SHARED_INDEXES, fetched_shared
    from trainer.data.sources import IndexRef

    victim = victim_dir(tmp_path)
    cache = tmp_path / "c" / "rank-00000"
    if where == "rank dir":
        plant(cache, "symlink", victim)
        ds = resolve_data(str(dataset))
        sources = rank_sources(
            (DataSpec(path=str(dataset)),), [ds], [plan_shards(ds.shards, 1)], rank=0, world=1, cache=cache.parent
        )[0]
        order = schedule(sources, seed=1, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1)
        with pytest.raises(DataError, match=r"rank-00000 is a symlink to .*victim"):
            ShardCache(sources, cache).begin(order, 0, 0)
    else:
        plant(cache.parent / SHARED_INDEXES, "symlink", victim)
        ref = IndexRef(url="memory://linked/samples.index.npy", num_bytes=10, sha256="0" * 64)
        with pytest.raises(DataError, match=r"indexes is a symlink to .*victim"):
            fetched_shared(ref, cache)
    assert untouched(victim)
