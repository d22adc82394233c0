"""Export: a run's DCP checkpoint (RUN/checkpoints/step-N, from any number of ranks) -> read offline on CPU into
the run's model -> a `save_pretrained` dir (safetensors + config; LoRA merged, or the adapter alone) with the
dataset's processor copied beside it, so transformers loads model and processor offline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trainer.checkpoint import RUN_FILE, RUN_PROCESSOR, checkpoint_dir, latest_checkpoint
from trainer.cli import load_toml, run_tool
from trainer.config import EXPORT_DTYPES as DTYPE_NAMES
from trainer.config import ConfigError, TrainConfig, default
from trainer.data import DataError, local_processor, resolve_data
from trainer.families import Vocab
from trainer.options import Checkpointing, DataOptions, ModelOptions
from vlmprep_schemas.boundary import REMOTE, UnsafeDataset, UnsafeWrite, fresh_state_dir, read_state, remove_state
from vlmprep_schemas.processor_dir import processor_files

EXPORT_DTYPES = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float32)))
_MARKS = ("config.json", "adapter_config.json")  # an earlier export: the only non-empty dir --overwrite replaces


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """The options of `python -m trainer export`: which run and checkpoint, where to, in which dtype and layout."""

    run: str  # run dir (holds run.json, config.toml, checkpoints/)
    out: str
    step: int = 0  # 0 = the latest complete checkpoint
    dtype: str = default("export_dtype")
    adapter_only: bool = False  # LoRA runs: the adapter alone (peft layout) instead of merged weights
    processor: str = ""  # "" = the run's --processor, else the dataset's processor/
    overwrite: bool = False

    def __post_init__(self):
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
        if self.step < 0:
            raise ConfigError(f"step={self.step}: must be >= 0 (0 = the latest checkpoint)")


def read_run(run_dir: Path) -> tuple[TrainConfig, dict]:
    """The run's resolved options (config.toml) and what its checkpoints mean (run.json's identity)."""
    if not (run_dir / "config.toml").is_file() or not (run_dir / RUN_FILE).is_file():
        raise ConfigError(f"{run_dir}: not a trainer run dir (it needs config.toml and {RUN_FILE})")
    cfg = TrainConfig(**load_toml(str(run_dir / "config.toml")))
    try:
        identity = json.loads(read_state(run_dir / RUN_FILE))["identity"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{run_dir / RUN_FILE}: unreadable ({e})") from None
    return cfg, identity


def find_checkpoint(run_dir: Path, step: int) -> Path:
    """A run dir and a step (0: the newest complete one) -> that checkpoint's dir; a missing or incomplete one is a
    ConfigError."""
    if step == 0:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ConfigError(f"{run_dir}: no complete checkpoint in {checkpoint_dir(run_dir)}")
        return path
    path = checkpoint_dir(run_dir) / f"step-{step:08d}"
    if not (path / ".metadata").is_file():
        kept = (
            sorted(p.name for p in checkpoint_dir(run_dir).glob("step-*") if (p / ".metadata").is_file())
            if checkpoint_dir(run_dir).is_dir()
            else []
        )
        raise ConfigError(f"{run_dir}: no checkpoint for step {step} (kept: {', '.join(kept) or 'none'})")
    return path


def _base_model_dir(options: ModelOptions, identity: dict) -> str:
    """The --model dir as run.json resolved it (config.toml keeps the path as typed, relative to where the run
    started); its config.json must be the one trained, since it shapes the exported architecture."""
    model = identity.get("model") or options.model
    config = Path(model) / "config.json"
    if not config.is_file():
        raise ConfigError(f"base model {model}: no config.json there (the export rebuilds the run's model from it)")
    if identity.get("model_config") and hashlib.sha256(config.read_bytes()).hexdigest() != identity["model_config"]:
        raise ConfigError(f"base model {model}: config.json changed since the run trained from it")
    return model


def load_trained_model(run_dir: str | Path, *, step: int = 0) -> tuple[torch.nn.Module, ModelOptions, Path]:
    """The run's model (fp32, CPU, eval mode) with the checkpoint's weights, read without a process group: DCP
    reassembles the FSDP shards of every rank into the full tensors of this one-process model."""
    import torch.distributed.checkpoint as dcp

    from trainer.model import build_model

    run_dir = Path(run_dir)
    cfg, identity = read_run(run_dir)
    options = ModelOptions.of(cfg)
    path = find_checkpoint(run_dir, step)
    model = _base_model_dir(options, identity) if options.model else ""
    net = build_model(replace(options, model=model, activation_checkpointing=False), _vocab(identity))
    state = {"model": net.state_dict()}  # tied weights share a tensor: loading either key fills both
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP's CheckpointException wraps the per-key errors
        raise ConfigError(
            f"{path}: cannot load the model weights into the run's model: {str(e).strip().splitlines()[-1][:300]}"
        ) from None
    net.eval()
    return net, options, path


def _vocab(identity: dict) -> Vocab | None:
    """The vocabulary a tiny random run's model was sized to, as run.json keeps it (None: a checkpoint's run)."""
    v = identity.get("tiny_vocab")
    return Vocab(size=int(v["size"]), ids=dict(v["ids"]), pad_id=int(v["pad_id"])) if v else None


def _base_use_cache(options: ModelOptions, run_dir: str) -> bool:
    from transformers import AutoConfig

    from trainer.model import tiny_config

    if options.tiny_random:
        return bool(getattr(tiny_config(options.tiny_random, _vocab(read_run(Path(run_dir))[1])), "use_cache", True))
    model = _base_model_dir(options, read_run(Path(run_dir))[1])
    return bool(
        getattr(AutoConfig.from_pretrained(model, local_files_only=True, trust_remote_code=False), "use_cache", True)
    )


def _processor_files(options: DataOptions, processor: str, run_dir: Path) -> tuple[Path, list[Path]]:
    """The processor the shards were rendered with: --processor, the run's --processor, or the dataset's copy (a
    mixture's first dataset: mixed datasets share vocabulary, family and image settings, checked at start-up); for a
    run's processor in a bucket, the copy the run kept in RUN/processor (keep_processor); with the files the export
    copies (_ship)."""
    location = processor or options.processor
    data = options.sources[0].path
    if not processor and (location or data).startswith(REMOTE):  # read at start-up, not from the bucket now
        kept = run_dir / RUN_PROCESSOR
        if kept.is_symlink() or not kept.is_dir():
            raise ConfigError(
                f"processor of {location or data}: the run dir {run_dir} holds no copy of it in {RUN_PROCESSOR}/ "
                "(runs keep one since the trainer fetches it at start-up): pass --processor DIR with the processor "
                "the shards were built with"
            )
        return _ship(str(kept), named=False)
    if not location:
        try:
            location = resolve_data(data).processor  # its manifest's paths checked to stay inside the dataset
        except DataError as e:
            raise ConfigError(f"cannot find the dataset's processor ({e}): pass --processor DIR") from None
        if not location:
            raise ConfigError(f"--data {data} has no manifest naming its processor: pass --processor DIR")
    return _ship(location, named=bool(processor or options.processor))


def _ship(location: str, *, named: bool) -> tuple[Path, list[Path]]:
    """A local processor dir the export can ship, and its files: the processor's own (processor_files), each inside
    its dir (`named`: a dir the user named may link out, a dataset's stays inside it), never a stray file beside
    them."""
    if location.startswith(REMOTE) or not Path(location, "tokenizer_config.json").is_file():
        raise ConfigError(
            f"processor {location}: not a local processor dir (no tokenizer_config.json): pass "
            "--processor DIR with the processor the shards were built with"
        )
    try:
        return Path(location), processor_files(location, links_out=named)
    except UnsafeDataset as e:
        raise ConfigError(str(e)) from None


def export_ready(location: str, ckpt: Checkpointing, options: DataOptions, *, rank: int, world: int) -> None:
    """Start-up, before the run dir is written: with --save-hf, what the export at the end needs is checked now, as
    it will be then (RUN/hf absent or an earlier export; the processor `location` a dir it can ship, unless it is
    in a bucket: keep_processor copies and checks that one), so nothing known at start-up fails a run after its
    training. Rank 0 checks; a refusal is one line on every rank."""

    def check() -> None:
        if ckpt.save_hf:
            _check_out(Path(ckpt.out) / "hf", overwrite=True)
            if not location.startswith(REMOTE):
                _processor_files(options, "", Path(ckpt.out))

    _on_rank_0(check, rank=rank, world=world)


def keep_processor(location: str, ckpt: Checkpointing, *, rank: int, world: int) -> None:
    """Start-up, once the run dir is set up: where the run's processor (`location`) is not a local dir (a bucket's
    dataset, a --processor URL), rank 0 copies its files (checked as any processor) into RUN/processor, where the
    export finds it however long the run takes (credentials that expire, a bucket that changes); with --save-hf it
    must be one the export can ship. A refusal is one line on every rank."""

    def copy() -> None:
        if location.startswith(REMOTE):
            _copy_processor(location, Path(ckpt.out) / RUN_PROCESSOR)
            if ckpt.save_hf:
                _ship(str(Path(ckpt.out) / RUN_PROCESSOR), named=False)

    _on_rank_0(copy, rank=rank, world=world)


def _on_rank_0(check, *, rank: int, world: int) -> None:
    """`check()` on rank 0; what it refuses (an export's ConfigError, a fetch's DataError, a planted link) is raised
    as one ConfigError on every rank, so none waits for a rank that has stopped."""
    refusal = ""
    if rank == 0:
        try:
            check()
        except ConfigError as e:
            refusal = f"--save-hf: {e}"
        except (DataError, UnsafeWrite) as e:
            refusal = str(e)
    if world > 1:
        shared = [refusal]
        torch.distributed.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal:
        raise ConfigError(refusal)


def _copy_processor(location: str, dest: Path) -> None:
    """The processor's files at `location` (a URL) -> `dest`, assembled in a fresh dir beside it and renamed into
    place; what is at `dest` is replaced only if it is a plain dir (a link planted there is refused, never followed)."""
    if os.path.islink(dest) or (os.path.lexists(dest) and not dest.is_dir()):
        raise UnsafeWrite(
            f"{dest} is a symlink or not a dir where the run keeps its processor: remove it and run again"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))  # new, so nothing planted is in the way
    try:
        local_processor(location, tmp)
        if dest.is_dir():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_out(out: Path, overwrite: bool) -> None:
    """--out may be written: absent, empty, or (with `overwrite`) an earlier export; a link is never written through."""
    if os.path.islink(out):
        raise UnsafeWrite(f"{out} is a symlink where the export is written: remove it and run again")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ConfigError(f"--out {out} exists and is not empty: pass --overwrite to replace it, or another --out")
        if not out.is_dir() or not any((out / m).is_file() for m in _MARKS):
            raise ConfigError(
                f"--out {out} is not an earlier export (no {' or '.join(_MARKS)}): refusing to "
                "replace it; pick another --out"
            )


def _prepare_out(out: Path, overwrite: bool) -> Path:
    _check_out(out, overwrite)
    try:
        return fresh_state_dir(out.with_name(out.name + ".tmp"))
    except UnsafeWrite as e:
        raise ConfigError(str(e)) from None


def export_run(ecfg: ExportConfig) -> Path:
    """Write ecfg.out: model (or adapter) + processor, assembled in OUT.tmp and renamed into place when complete."""
    out = Path(ecfg.out)
    cfg, _ = read_run(Path(ecfg.run))
    if ecfg.adapter_only and not cfg.lora_rank:
        raise ConfigError(f"--adapter-only: {ecfg.run} is not a LoRA run (lora_rank = 0)")
    find_checkpoint(Path(ecfg.run), ecfg.step)  # fail before touching --out
    processor = _processor_files(DataOptions.of(cfg), ecfg.processor, Path(ecfg.run))
    tmp = _prepare_out(out, ecfg.overwrite)
    try:
        _write_export(ecfg, tmp, processor)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_state(out)  # the earlier export (or a link at its name: unlinked, its target kept)
    os.replace(tmp, out)
    return out


def _write_export(ecfg: ExportConfig, tmp: Path, processor: tuple[Path, list[Path]]) -> None:
    net, options, path = load_trained_model(ecfg.run, step=ecfg.step)
    dtype = EXPORT_DTYPES[ecfg.dtype]
    if options.lora_rank and ecfg.adapter_only:
        base = _base_model_dir(options, read_run(Path(ecfg.run))[1]) if options.model else None
        net.peft_config["default"].base_model_name_or_path = base  # tiny-random: no base on disk to name
        net.to(dtype).save_pretrained(str(tmp))
    else:
        if options.lora_rank:
            net = net.merge_and_unload()  # in fp32, before the cast
        net.config.use_cache = _base_use_cache(options, ecfg.run)  # training turned the KV cache off
        net.to(dtype).save_pretrained(str(tmp))
    where, files = processor
    for f in files:
        dest = tmp / f.relative_to(where)
        if dest.exists():
            raise ConfigError(f"processor file {f} would overwrite the model's own {dest.name}")
        dest.parent.mkdir(exist_ok=True)
        shutil.copy2(f, dest)
    (tmp / "export.json").write_text(
        json.dumps(
            {
                "run": str(Path(ecfg.run).resolve()),
                "checkpoint": path.name,
                "dtype": ecfg.dtype,
                "adapter_only": ecfg.adapter_only,
                "processor": str(where.resolve()),
            },
            indent=1,
        )
        + "\n"
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m trainer export",
        allow_abbrev=False,
        description="Write a run's checkpoint as a save_pretrained model dir with the "
        "dataset's processor (loads with AutoModelForImageTextToText and "
        "AutoProcessor).",
    )
    ap.add_argument("run", help="run dir (the trainer's --out)")
    ap.add_argument("--out", required=True, help="export dir (must be empty or absent, unless --overwrite)")
    ap.add_argument("--step", type=int, default=0, help="checkpoint step to export (default: the latest)")
    ap.add_argument(
        "--dtype",
        choices=tuple(EXPORT_DTYPES),
        default=default("export_dtype"),
        help=f"weight dtype (default: {default('export_dtype')})",
    )
    ap.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA runs: write the adapter alone in peft's layout instead of merged weights",
    )
    ap.add_argument(
        "--processor",
        default="",
        help="processor dir to ship (default: the run's --processor, else the dataset's processor/)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    return ap


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer export RUN --out DIR ...` -> exit status: a run's checkpoint written as a transformers
    model dir (or a LoRA adapter); a bad option is one line and exit 1."""
    ns = _parser().parse_args(argv)
    return run_tool(
        "trainer export",
        lambda: export_run(
            ExportConfig(
                run=ns.run,
                out=ns.out,
                step=ns.step,
                dtype=ns.dtype,
                adapter_only=ns.adapter_only,
                processor=ns.processor,
                overwrite=ns.overwrite,
            )
        ),
    )
