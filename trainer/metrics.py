"""Run log on rank 0: one JSON line per step in RUN/metrics.jsonl, TensorBoard scalars in RUN/tb/, a progress
bar on the terminal, and every --log-every steps a plain-text line in RUN/train.log (and on stdout off a terminal)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trainer.families import family_of_model
from vlmprep_schemas.boundary import open_no_follow, read_state, state_dir

LOG_NAME = "train.log"


def plural(n: int, word: str) -> str:
    """`1 shard`, `2 shards`: what the start-up lines count."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def truncate_metrics(path: Path, last_step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their lines from the killed run."""
    if not os.path.lexists(path):
        return
    with open_no_follow(path, "a+b") as f:  # a link planted in the run dir is neither read nor written through
        f.seek(0)
        keep = [
            ln for ln in f.read().decode("utf-8").splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step
        ]
        f.truncate(0)
        f.write("".join(ln + "\n" for ln in keep).encode("utf-8"))


def eval_logged(run_dir: Path, step: int, names: list[str] | None) -> bool:
    """An eval row of `step` over these eval sets (names None: one unnamed set) is in RUN/metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return False
    for line in read_state(path, 1 << 40).decode("utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("step") == step and "eval_loss" in row:
            by_set = row.get("eval_loss_by_source")
            if (sorted(by_set) if by_set is not None else None) == (sorted(names) if names is not None else None):
                return True
    return False


# metrics.jsonl key -> TensorBoard tag; every numeric `eval_*` key (or a dict of them, per source) goes to eval/.
TB_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "pack_fill": "perf/pack_fill",
    "data_wait_s": "perf/data_wait_s",
    "mfu": "perf/mfu",
}


def tb_scalars(record: dict) -> dict[str, float]:
    """The TensorBoard scalars of one metrics record: tag -> value."""
    out = {tag: float(record[k]) for k, tag in TB_TAGS.items() if isinstance(record.get(k), (int, float))}
    for k, v in record.items():
        if not k.startswith("eval_"):
            continue
        tag = "eval/" + k[len("eval_") :]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[tag] = float(v)
        elif isinstance(v, dict):
            out.update({f"{tag}/{s}": float(x) for s, x in v.items() if isinstance(x, (int, float))})
    return out


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def step_line(record: dict, *, total: int | None, eta_s: float | None) -> str:
    """The plain-text line of one step, for a log a person reads (RUN/train.log, a Slurm job's stdout)."""
    return (
        f"trainer: step {record['step']}{f'/{total}' if total else ''} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.3g} | grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s | "
        f"data wait {record['data_wait_frac']:.0%} | ETA {_clock(eta_s) if eta_s is not None else 'unknown'}"
    )


class RunLog:
    """Rank 0's record of a run: metrics.jsonl (one JSON row per step and eval; rows past a resume's step are cut),
    train.log's step lines, the progress bar and, where installed and asked for, TensorBoard scalars."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int | None,
        start_step: int,
        progress: bool,
        tensorboard: bool,
        log_every: int,
        echo: bool = False,
    ):
        """log_every: a step_line at step 1 and every N steps into RUN/train.log (0: none); echo: also on stdout."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_metrics(self.path, start_step)
        self.file = open_no_follow(self.path, "a", encoding="utf-8")
        self.text = open_no_follow(Path(run_dir) / LOG_NAME, "a", encoding="utf-8")
        self.log_every, self.echo = log_every, echo
        self.total, self.start_step, self.t0 = total_steps, start_step, time.perf_counter()
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resume redoes the steps after its checkpoint: purge_step hides the killed run's events from there
            # on, so TensorBoard shows each step once, as metrics.jsonl does.
            self.tb = SummaryWriter(  # RUN/tb a real dir of the run's (a link planted there: refused)
                log_dir=str(state_dir(Path(run_dir) / "tb")), purge_step=start_step + 1 if start_step else None
            )
        self.bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[tps]:.0f} tok/s"),
            TimeRemainingColumn(),
            disable=not progress,
        )
        self.bar.start()
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step, loss=float("nan"), tps=0.0)

    def step(self, record: dict) -> None:
        """One step's metrics row -> metrics.jsonl, the progress bar, TensorBoard, and every `log_every` steps a step
        line (with the ETA) into train.log (and stdout when echoing)."""
        self._write(record)
        self.bar.update(self.task, completed=record["step"], loss=record["loss"], tps=record["tokens_per_s"])
        step = record["step"]
        if self.log_every and (step == 1 or step % self.log_every == 0):
            done = step - self.start_step  # this session's steps time the rest
            eta = ((time.perf_counter() - self.t0) / done * (self.total - step)) if self.total and done else None
            self.note(step_line(record, total=self.total, eta_s=eta), echo=self.echo)

    def note(self, line: str, *, echo: bool = False) -> None:
        """A line for RUN/train.log (and stdout with echo): the step lines, evals, the run's closing line."""
        self.text.write(line + "\n")
        self.text.flush()
        if echo:
            print(line, flush=True)

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=True) + "\n")
        self.file.flush()
        if self.tb is not None:
            for tag, value in tb_scalars(record).items():
                self.tb.add_scalar(tag, value, global_step=record["step"])
            # Drain the writer's queue every step, like metrics.jsonl: events a killed run still held would be lost for
            # good (its resume redoes only the steps after the checkpoint).
            self.tb.flush()

    def eval(self, record: dict, line: str = "") -> None:
        """An eval row (trainer/evaluate.py): the same files, the progress bar untouched; `line` goes to train.log."""
        self._write(record)
        if line:
            self.note(line)

    def close(self) -> None:
        """Stops the progress bar and closes the files (and the TensorBoard writer)."""
        self.bar.stop()
        self.file.close()
        self.text.close()
        if self.tb is not None:
            self.tb.close()


# Dense bf16 peak FLOP/s by device name (no sparsity), for `mfu`; unknown devices get no mfu.
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "4090": 165e12,
}


def peak_flops(device) -> float | None:
    """The bf16 dense peak FLOP/s of a known CUDA device (for MFU); None on CPU or an unknown card."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


class FlopCounter:
    """Training FLOPs (forward + backward = 3 x forward) from the model's parameter counts: 6 x text parameters
    (lm head included) per token, 6 x vision parameters (tower and projector) per image patch, and causal attention
    6 x layers x hidden x sum of squared sample lengths (packed samples do not attend to each other)."""

    def __init__(self, net):
        cfg = getattr(net.config, "text_config", net.config)
        self.layers, self.hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
        family = family_of_model(str(net.config.model_type))
        parts = family.vision if family else ("visual",)
        self.sized = family is not None and family.pixels == "normalize"  # its grid rows are image sizes
        vision = getattr(net.config, "vision_config", None)
        patch = getattr(vision, "patch_size", 14)
        self.patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
        side = getattr(vision, "image_size", 0)  # Mllama's tile
        self.tile = int(side[0] if isinstance(side, (list, tuple)) else side or 0)
        self.vision = self.text = 0
        seen = set()
        for name, p in net.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if any(f".{part}." in f".{name}" for part in parts):
                self.vision += p.numel()
            elif "embed_tokens" not in name or getattr(net.config, "tie_word_embeddings", False):
                self.text += p.numel()  # a tied embedding is counted once, as the lm head's matmul

    def step(self, batches) -> float:
        """The training FLOPs of one step's micro-batches (empty ones count 0)."""
        flops = 0.0
        for b in batches:
            if not b.num_samples:
                continue
            lens = [len(p) for p in _segments(b)]
            flops += 6 * (self.text * sum(lens) + self.layers * self.hidden * sum(n * n for n in lens))
            # The patchify families' grids count patches; the host families' pixel_values hold them (tiles, crops: an
            # estimate); the grid rows of images normalized on the device (Gemma 3) are their sizes, 1 x H x W;
            # Gemma 4's position ids on the device path have a row per patch of its pixel_values, padding included, and
            # Mllama's aspect-ratio mask an entry per tile of its pixel_values
            pixels = b.vision.get("pixel_values")
            placed, tiled = b.vision.get("image_position_ids"), b.vision.get("aspect_ratio_mask")
            if pixels is not None:
                patches = pixels.numel() / (3 * self.patch * self.patch)
            elif placed is not None:
                patches = float(placed.shape[0] * placed.shape[1])
            elif tiled is not None:
                patches = tiled.numel() * self.tile * self.tile / (self.patch * self.patch)
            elif self.sized:
                patches = float(b.image_grid_thw.prod(-1).sum()) / (self.patch * self.patch)
            else:
                patches = float(b.image_grid_thw.prod(-1).sum())
            flops += 6 * self.vision * patches
        return flops


def _segments(b):
    """Sample lengths of a batch: its rows' lengths, or for a packed row the runs between position resets."""
    if not b.packed:
        return [range(int(n)) for n in b.lengths]
    starts = (b.position_ids[0, 0] == 0).nonzero().flatten().tolist() + [b.position_ids.shape[-1]]
    return [range(a, z) for a, z in zip(starts[:-1], starts[1:])]
