"""Checkpoints on their own (a tiny Linear model, one process, no process group): a checkpoint is complete only with
its marker, written last, whose file sizes still hold; a resume takes the newest complete one, naming each one it
skips, and refuses in one line when none is left; pruning keeps complete ones. The run dir lock: one holder, a file
left by a killed run never blocks. A whole run resuming past a cut checkpoint: test_run_safety.py."""

import json
import warnings

import pytest
import torch

from trainer.checkpoint import (
    MARKER,
    RUN_LOCK,
    TrainState,
    checkpoint_problem,
    latest_checkpoint,
    load_latest,
    own_run_dir,
    save_checkpoint,
)
from trainer.config import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_process():
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def _train_and_save(run, steps, keep=3):
    net, opt = _model()
    weights = {}
    for step in steps:
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        save_checkpoint(
            run,
            TrainState(step=step, epoch=0, position=10 * step, pack_state=[]),
            net=net,
            optimizer=opt,
            device=CPU,
            keep_checkpoints=keep,
        )
        weights[step] = net.weight.detach().clone()
    return weights


def _ckpt(run, step):
    return run / "checkpoints" / f"step-{step:08d}"


def _cut(path):
    f = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])
    return f.name, size


def test_the_marker_is_written_last_and_lists_every_file(tmp_path):
    _train_and_save(tmp_path, [1])
    path = _ckpt(tmp_path, 1)
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 1 and set(marker["files"]) == {p.name for p in path.iterdir()} - {MARKER}
    assert checkpoint_problem(path) is None and latest_checkpoint(tmp_path) == path
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_a_resume_falls_back_past_cut_and_unfinished_checkpoints_naming_each(tmp_path, capsys):
    weights = _train_and_save(tmp_path, [1, 2, 3])
    name, size = _cut(_ckpt(tmp_path, 3))
    (_ckpt(tmp_path, 2) / MARKER).unlink()
    (_ckpt(tmp_path, 2) / ".metadata").unlink()  # as a save killed before its marker leaves it (once renamed)
    assert latest_checkpoint(tmp_path) == _ckpt(tmp_path, 1)
    net, opt = _model()
    path, resumed = load_latest(tmp_path, net=net, optimizer=opt, device=CPU)
    assert path == _ckpt(tmp_path, 1) and resumed.step == 1 and resumed.position == 10
    assert torch.equal(net.weight, weights[1])
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"trainer: skipped checkpoint {_ckpt(tmp_path, 3)}: {name} has {size // 2} bytes, {size} when saved "
        "(cut short); resuming from the one before it",
        f"trainer: skipped checkpoint {_ckpt(tmp_path, 2)}: no {MARKER} (the save did not finish); resuming "
        "from the one before it",
    ]


def test_a_checkpoint_that_passes_its_sizes_but_does_not_load_is_skipped_too(tmp_path, capsys):
    """Same size, other bytes (or a checkpoint from before markers that was cut): DCP's error is caught, the run
    goes back one more; with none left it refuses in one line rather than train on a half-loaded model."""
    _train_and_save(tmp_path, [1, 2])
    for step in (1, 2):
        meta = _ckpt(tmp_path, step) / ".metadata"
        meta.write_bytes(b"\0" * meta.stat().st_size)
    net, opt = _model()
    with pytest.raises(
        ConfigError,
        match=r"holds no complete checkpoint \(step-00000002: unreadable \(.*"
        r"step-00000001: unreadable .*--no-resume",
    ):
        load_latest(tmp_path, net=net, optimizer=opt, device=CPU)
    assert capsys.readouterr().err.count("trainer: skipped checkpoint") == 2


def test_a_checkpoint_from_before_markers_still_resumes(tmp_path):
    weights = _train_and_save(tmp_path, [1])
    (_ckpt(tmp_path, 1) / MARKER).unlink()
    net, opt = _model()
    path, resumed = load_latest(tmp_path, net=net, optimizer=opt, device=CPU)
    assert resumed.step == 1 and torch.equal(net.weight, weights[1])


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    _train_and_save(tmp_path, [1, 2], keep=2)
    _cut(_ckpt(tmp_path, 2))
    net, opt = _model()
    save_checkpoint(
        tmp_path,
        TrainState(step=3, epoch=0, position=0, pack_state=[]),
        net=net,
        optimizer=opt,
        device=CPU,
        keep_checkpoints=2,
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000003"]


def test_the_run_dir_has_one_owner_and_a_killed_ones_file_does_not_block(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_LOCK).write_text(json.dumps({"pid": 1, "host": "gone", "since": "-", "command": "killed"}))
    with own_run_dir(run):
        held = json.loads((run / RUN_LOCK).read_text())
        assert held["pid"] != 1 and held["command"]
        with pytest.raises(ConfigError, match=rf"^{run} is in use by another trainer \(pid {held['pid']} on "):
            with own_run_dir(run):  # another open file: flock refuses it as it refuses another process
                pass
    assert not (run / RUN_LOCK).exists()


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ConfigError, match=r"^--out .*/file/run: cannot create it or its trainer.lock \(Not a directory"
    ):
        with own_run_dir(tmp_path / "file" / "run"):
            pass
