"""`python -m benchmarks.peers --end-to-end`: what a whole run's data costs per core, each tool's preprocessing plus
`--epochs` passes of its own train-time data path over what that preprocessing wrote, on the same records.

Each train-time pass is a driver run in a fresh process on one core (taskset), in the tool's own venv: it sets up
(imports, processor, dataset), then runs one DataLoader pass per epoch (batch `--e2e-batch`, num_workers 0) and
prints one line `E2E {json}` with the CPU seconds (user + system, its children included) of the set-up and of each
epoch, and what each epoch delivered (samples, tokens, images), so a reader can see every tool did the same work.

- vlmprep: the trainer's loader, built as `python -m trainer` builds it (open_data, read_plan, make_loader, one
  StepLoader epoch after another) without the model step. The rescale, normalize and patchify that `python -m
  trainer` runs on the GPU (Patchifier) run here on this CPU too, so every batch ends with the same pixel_values as
  the peers' collators make on the host; their CPU seconds are counted apart (`patchify_cpu_s`), not in the epoch's.
- LLaMA-Factory: its SFT collator (SFTDataCollatorWith4DAttentionMask, as run_sft builds it, the processor making
  pixel_values of every image of the batch) over the tokenized dataset its preprocessing saved.
- ms-swift: its LazyLLMDataset over the cached dataset (the template's encode of every row: template, tokenizer
  and the whole image path) and the template's data collator.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Shared by every driver: the process's CPU seconds so far (user + system, finished children included). The process's
# own by process_time (ns), not os.times (10 ms ticks): an epoch of a few samples is a few ticks, and vlmprep's epoch
# less its patchify (timed by process_time) must not mix the two resolutions.
PRELUDE = """
import json, os, sys, time
def _cpu():
    t = os.times()
    return time.process_time() + t.children_user + t.children_system
"""

VLMPREP_EPOCHS = (
    PRELUDE
    + """
args = json.loads(sys.argv[1])
sys.path.insert(0, args.pop("repo"))
from benchmarks.peers.endtoend import vlmprep_epochs
print("E2E " + json.dumps(vlmprep_epochs(**args)), flush=True)
"""
)


# A peer driver's end, after its set-up made `dataset` and `collator` (and `cpu0`, its CPU seconds before the set-up):
# the DataLoader the peer's trainer makes of them (a random sampler, the collator as collate_fn; one process), one
# pass per epoch, each batch checked to carry MRoPE positions and the pixel_values of every image its grid names.
PEER_EPOCHS = """
loader = DataLoader(
    dataset, batch_size=args["batch"], shuffle=True, collate_fn=collator, num_workers=0,
    generator=torch.Generator().manual_seed(0),
)
out = {"setup_cpu_s": _cpu() - cpu0, "epochs": [], "dataset": type(dataset).__name__}
for epoch in range(args["epochs"]):
    c0, t0 = _cpu(), time.perf_counter()
    samples = tokens = images = 0
    for batch in loader:
        assert batch["position_ids"].dim() == 3
        samples += batch["input_ids"].shape[0]
        mask = batch.get("attention_mask")
        tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        if batch.get("image_grid_thw") is not None:
            images += batch["image_grid_thw"].shape[0]
            assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=1).sum())
    out["epochs"].append({"cpu_s": round(_cpu() - c0, 3), "seconds": round(time.perf_counter() - t0, 3),
                          "samples": samples, "tokens": tokens, "images": images})
print("E2E " + json.dumps(out), flush=True)
"""

# LLaMA-Factory's run_sft up to its trainer (llamafactory/train/sft/workflow.py): the tokenized dataset loaded from
# tokenized_path (what the preprocessing saved), the collator as run_sft builds it, and the DataLoader the HF Trainer
# makes of them (random sampler, the collator as collate_fn). run_sft's load_model would load weights, which the
# processor dir has none of: the collator takes the model only for get_rope_index (Qwen2-VL's MRoPE positions, from
# the config), so the model is built on the meta device.
LF_EPOCHS = (
    PRELUDE
    + """
args = json.loads(sys.argv[1])
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, Qwen2VLForConditionalGeneration
from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
from llamafactory.extras.constants import IGNORE_INDEX
from llamafactory.hparams import get_train_args
from llamafactory.model import load_tokenizer
cpu0 = _cpu()
model_args, data_args, training_args, _, _ = get_train_args(json.loads(open(args["config"]).read()))
tokenizer_module = load_tokenizer(model_args)
template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
dataset = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)["train_dataset"]
with torch.device("meta"):
    model = Qwen2VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(model_args.model_name_or_path))
collator = SFTDataCollatorWith4DAttentionMask(
    template=template,
    model=model,
    pad_to_multiple_of=8,
    label_pad_token_id=IGNORE_INDEX,
    block_diag_attn=model_args.block_diag_attn,
    neat_packing=data_args.neat_packing,
    attn_implementation=getattr(model.config, "_attn_implementation", None),
    compute_dtype=model_args.compute_dtype,
    **tokenizer_module,
)
"""
    + PEER_EPOCHS
)

# ms-swift's `swift sft --cached_dataset DIR` up to its trainer (swift/pipelines/train/sft.py SwiftSft): the args
# parsed as its CLI parses them, the model built the way its cached-dataset export builds it (a dummy on the meta
# device: Qwen2-VL's template takes the model for get_rope_index only), the template in train mode, the dataset as
# _prepare_dataset makes it (the cached rows in a LazyLLMDataset that runs template.encode on every access), and the
# trainer's collator (partial(template.data_collator, padding_to=None)) in a DataLoader over it.
SWIFT_EPOCHS = (
    PRELUDE
    + """
args = json.loads(sys.argv[1])
import torch
from torch.utils.data import DataLoader
from functools import partial
from swift.pipelines.train.sft import SwiftSft
cpu0 = _cpu()

class TrainTimeData(SwiftSft):
    def __init__(self, argv):
        super(SwiftSft, self).__init__(argv)
        self.train_msg = {}
        with torch.device("meta"):
            self._prepare_model_tokenizer(return_dummy_model=True)
        self._prepare_template()

sft = TrainTimeData(args["argv"])
dataset, _ = sft._prepare_dataset()
from swift.dataset import LazyLLMDataset
assert isinstance(dataset, LazyLLMDataset), type(dataset)  # the encode runs at every access
collator = partial(sft.template.data_collator, padding_to=None)
"""
    + PEER_EPOCHS
)


def vlmprep_epochs(dataset: str, processor: str, run_dir: str, epochs: int, batch: int) -> dict:
    """`epochs` passes of the trainer's data path over a vlmprep dataset, on one process (num_workers 0): the
    StepLoader that `python -m trainer` makes (trainer/train.py run), then each micro-batch's pixel_values made on
    this CPU by the trainer's Patchifier. CPU seconds of the set-up and of each epoch, the Patchifier's apart (the
    trainer runs it on the GPU)."""
    import torch

    from trainer.config import TrainConfig
    from trainer.data import (
        CollateSpec,
        Patchifier,
        data_streams,
        keep_freed_buffers,
        make_loader,
        open_data,
        read_plan,
    )
    from trainer.model import model_type_of
    from trainer.options import Batching, DataOptions, RunLength
    from vlmprep.processors.load import load_processor

    cpu0 = _cpu()
    keep_freed_buffers()
    cfg = TrainConfig(data=dataset, model=processor, epochs=epochs, micro_batch_size=batch, num_workers=0, out=run_dir)
    data = open_data(
        DataOptions.of(cfg), model_type=model_type_of(model=processor, tiny_random=""), packing=False, world=1
    )
    plan = read_plan(DataOptions.of(cfg), data, rank=0)
    cfg = dataclasses.replace(cfg, shuffle_span=plan.shuffle_span)
    tok = load_processor(processor).tokenizer
    spec = CollateSpec(
        pad_id=tok.pad_token_id,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        patch_size=data.image.patch_size,
        merge_size=data.image.merge_size,
    )
    options, batching, length = DataOptions.of(cfg), Batching.of(cfg), RunLength.of(cfg)
    read = data_streams(options, plan, data, batching=batching, length=length, device=torch.device("cpu"))
    loader, _, _ = make_loader(read, options, spec, batching=batching, length=length)
    patchify = Patchifier(data.image, "cpu")
    out = {"setup_cpu_s": _cpu() - cpu0, "epochs": []}
    for epoch in range(epochs):
        c0, t0 = _cpu(), time.perf_counter()
        loader.start(epoch, 0)
        samples = tokens = images = 0
        device = 0.0  # CPU seconds of the step the trainer runs on the GPU (process_time: ns, not 10 ms, ticks)
        while (mb := loader.next_step()[0]).num_samples:
            if mb.image_index:
                p0 = time.process_time()
                pv = patchify(mb.images, mb.image_index)
                device += time.process_time() - p0
                assert pv.shape[0] == int(mb.image_grid_thw.prod(dim=1).sum())
            samples, tokens, images = samples + mb.num_samples, tokens + mb.num_tokens, images + len(mb.image_index)
        row = _epoch(c0, t0, samples, tokens, images)
        out["epochs"].append({**row, "cpu_s": round(row["cpu_s"] - device, 3), "patchify_cpu_s": round(device, 3)})
    loader.close()
    return out


def _cpu() -> float:  # PRELUDE's
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def _epoch(c0: float, t0: float, samples: int, tokens: int, images: int) -> dict:
    return {
        "cpu_s": round(_cpu() - c0, 3),
        "seconds": round(time.perf_counter() - t0, 3),
        "samples": samples,
        "tokens": tokens,
        "images": images,
    }


def run_driver(code: str, py: Path, args: dict, *, env: dict, log: Path, cores: str = "0") -> dict:
    """One driver in a fresh process on `cores`; its E2E line, plus the whole process's CPU seconds (start-up
    included) as the parent saw them. An error (exit status, no E2E line) is returned as {"error": ...}."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        res = subprocess.run(
            ["taskset", "-c", cores, str(py), "-c", code, json.dumps(args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
        )
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    line = next((x for x in reversed(res.stdout.splitlines()) if x.startswith("E2E ")), None)
    if res.returncode or line is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        return {"error": f"exit {res.returncode}: " + " | ".join(tail)}
    return {**json.loads(line[4:]), "process_cpu_s": round(cpu, 2), "seconds": round(time.perf_counter() - t0, 2)}


# The goals of issue 54, vlmprep's ratio to each peer per core: preprocessing per record shape, and end to end
# (preprocessing + the epochs' train-time data path) on both.
PREPROCESS_GOALS = {
    ("demo", "llamafactory"): 1.5,
    ("demo", "ms-swift"): 1.5,
    ("traces", "llamafactory"): 3.0,
    ("traces", "ms-swift"): 2.5,
}
END_TO_END_GOAL = 3.0


def driver(tool: str, result: dict, model: Path, epochs: int, batch: int) -> tuple[str, dict]:
    """The train-time driver of `tool` and its arguments, reading what its preprocessing wrote (`result`)."""
    common = {"epochs": epochs, "batch": batch}
    if tool == "vlmprep":
        run = str(Path(result["run_dir"]) / "trainer-run")
        return VLMPREP_EPOCHS, {
            "repo": str(REPO),
            "dataset": result["out"],
            "processor": str(model),
            "run_dir": run,
            **common,
        }
    if tool == "llamafactory":
        return LF_EPOCHS, {"config": str(Path(result["run_dir"]) / "llamafactory.yaml"), **common}
    assert tool == "ms-swift", tool
    argv = [
        *("--model", str(Path(model).resolve()), "--model_type", "qwen2_vl", "--template", "qwen2_vl"),
        *("--cached_dataset", str(Path(result["out"]).resolve() / "train"), "--max_length", str(result["seq_len"])),
        *("--split_dataset_ratio", "0", "--per_device_train_batch_size", str(batch), "--dataloader_num_workers", "0"),
        *("--output_dir", str(Path(result["run_dir"]).resolve() / "swift-train"), "--report_to", "none"),
    ]
    return SWIFT_EPOCHS, {"argv": argv, **common}


def train_time(result: dict, tool: str, py: Path, model: Path, env: dict, epochs: int, batch: int) -> dict:
    """The tool's train-time passes over its preprocessed output (`result`, its preprocessing row): one E2E row
    emitted, with what each step cost in CPU seconds on one core; returned (the preprocessing row where it failed)."""
    from benchmarks.emit import emit

    code, args = driver(tool, result, model, epochs, batch)
    log = Path(result["run_dir"]) / "train-time.txt"
    r = run_driver(code, py, args, env=env, log=log)
    row = {"input": result["input"], "tool": tool, "records": result["records"], "images": result["images"]}
    if "error" in r:
        emit("peers", metric="e2e", **row, error=r["error"], log=str(log))
        return result
    eps = r["epochs"]
    # Preprocessing: the full run less the 1-record run (its start-up), scaled back to every record.
    n, one = result["records"], result["one_records"]
    pre = (result["cpu_seconds"] - result["startup_cpu_seconds"]) * n / max(n - one, 1)
    load = sum(e["cpu_s"] for e in eps)
    # The process's CPU less its epochs' (and vlmprep's patchify, the GPU's share): imports, processor, dataset open.
    load_startup = r["process_cpu_s"] - load - sum(e.get("patchify_cpu_s", 0.0) for e in eps)
    e2e = emit(
        "peers",
        metric="e2e",
        **row,
        epochs=len(eps),
        batch=batch,
        preprocess_cpu_s=round(pre, 2),
        preprocess_startup_cpu_s=result["startup_cpu_seconds"],
        load_cpu_s_per_epoch=round(load / len(eps), 2),
        load_cpu_s_epochs=[e["cpu_s"] for e in eps],
        load_startup_cpu_s=round(load_startup, 2),
        total_cpu_s=round(pre + load, 2),
        total_with_startups_cpu_s=round(pre + load + result["startup_cpu_seconds"] + load_startup, 2),
        ms_per_record=round(1000 * (pre + load) / n, 3),
        # What every epoch delivered: every tool must train every record (and its images) each epoch.
        samples_per_epoch=[e["samples"] for e in eps],
        tokens_per_epoch=eps[0]["tokens"],
        images_per_epoch=[e["images"] for e in eps],
        load_seconds_epochs=[e["seconds"] for e in eps],
        # vlmprep: the GPU's share (rescale, normalize, patchify), run on this CPU as well and counted apart
        **({"patchify_cpu_s_epochs": [e["patchify_cpu_s"] for e in eps]} if "patchify_cpu_s" in eps[0] else {}),
        load_avg_1m=[round(x, 2) for x in os.getloadavg()],
        **({"dataset_class": r["dataset"]} if "dataset" in r else {}),
    )
    return {**result, "e2e": e2e}


def ratios(results: dict[tuple[str, str], dict]) -> list[dict]:
    """vlmprep against each peer on each input, per core (CPU seconds on the same records): preprocessing and end to
    end, each beside its goal. Emitted; returned for the summary."""
    from benchmarks.emit import emit

    rows = []
    for (name, tool), res in _ordered(results):
        base = results.get((name, "vlmprep"))
        if tool == "vlmprep" or base is None or "e2e" not in res or "e2e" not in base:
            continue
        a, b = base["e2e"], res["e2e"]
        with_patchify = a["total_cpu_s"] + sum(a.get("patchify_cpu_s_epochs", ()))
        pre = round(b["preprocess_cpu_s"] / a["preprocess_cpu_s"], 2) if a["preprocess_cpu_s"] > 0 else None
        tot = round(b["total_cpu_s"] / a["total_cpu_s"], 2) if a["total_cpu_s"] > 0 else None
        pre_goal = PREPROCESS_GOALS.get((name, tool))
        rows.append(
            emit(
                "peers",
                metric="e2e_ratio",
                input=name,
                vs=tool,
                preprocess=pre,
                preprocess_goal=pre_goal,
                preprocess_met=None if pre is None or pre_goal is None else pre >= pre_goal,
                end_to_end=tot,
                end_to_end_goal=END_TO_END_GOAL,
                end_to_end_met=None if tot is None else tot >= END_TO_END_GOAL,
                load_per_epoch=round(b["load_cpu_s_per_epoch"] / a["load_cpu_s_per_epoch"], 2)
                if a["load_cpu_s_per_epoch"] > 0
                else None,
                # vlmprep with the GPU's rescale, normalize and patchify run on the CPU as well (the peers' collators
                # run theirs there): the end-to-end ratio of a run without a GPU to take that step
                end_to_end_patchify_on_cpu=round(b["total_cpu_s"] / with_patchify, 2) if with_patchify > 0 else None,
            )
        )
    return rows


def summary(results: dict[tuple[str, str], dict], file=None) -> str:
    """The end-to-end table (CPU seconds on one core) and the ratios, as text for a terminal (stderr by default)."""
    import sys

    ratio_rows = ratios(results)
    lines = [
        "| input | tool | records | preprocess CPU s | load CPU s / epoch | epochs | total CPU s | ms / record | "
        "start-ups CPU s (preprocess + load) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (name, tool), res in _ordered(results):
        e = res.get("e2e")
        if e is None:
            lines.append(
                f"| {name} | {tool} | {res['records']} | (train-time pass failed: see its e2e row) | | | | | |"
            )
            continue
        patch = e.get("patchify_cpu_s_epochs")
        gpu = f" (+ {round(sum(patch) / len(patch), 2)} of the GPU's patchify)" if patch else ""
        lines.append(
            f"| {name} | {tool} | {e['records']} | {e['preprocess_cpu_s']} | {e['load_cpu_s_per_epoch']}{gpu} | "
            f"{e['epochs']} | {e['total_cpu_s']} | {e['ms_per_record']} | "
            f"{e['preprocess_startup_cpu_s']} + {e['load_startup_cpu_s']} |"
        )
    lines += [
        "",
        "| input | vlmprep vs | preprocess (goal) | end to end (goal) | load per epoch | end to end, patchify on CPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in ratio_rows:
        lines.append(
            f"| {r['input']} | {r['vs']} | {r['preprocess']}x (>= {r['preprocess_goal']}x: "
            f"{_met(r['preprocess_met'])}) | {r['end_to_end']}x (>= {r['end_to_end_goal']}x: "
            f"{_met(r['end_to_end_met'])}) | {r['load_per_epoch']}x | {r['end_to_end_patchify_on_cpu']}x |"
        )
    text = "\n".join(lines)
    print(text, file=file or sys.stderr, flush=True)
    return text


def _ordered(results: dict[tuple[str, str], dict]) -> list:
    """Rows by input, then vlmprep, LLaMA-Factory, ms-swift."""
    order = ("vlmprep", "llamafactory", "ms-swift")
    return sorted(results.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]) if kv[0][1] in order else 9))


def _met(flag: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "n/a"}[flag]
