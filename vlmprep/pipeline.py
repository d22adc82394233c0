"""The build, top to bottom in flow order:

    inputs --records--> RawRecord --parse/normalize--> Conversation --prepare_image--> PreparedImage
           --render_conversation--> RenderedSample --truncate_sample--> --encode_sample--> ShardSample
           --ShardWriter--> shard-*.tar  (+ rejects.jsonl, processor/, manifest.json last)

Records are processed by N worker processes but written strictly in input order, so the output is
byte-identical whatever N is. Every bad record becomes a counted reject, never a crash.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from vlmprep import __version__
from vlmprep.clients.energon_meta import write_energon_meta
from vlmprep.config import BuildConfig
from vlmprep.images import prepare_image
from vlmprep.normalize import NormalizeOptions, normalize_record
from vlmprep.processor import apply_pixel_budget, load_processor, load_saved_processor, save_processor
from vlmprep.records import expand_inputs, iter_records, parse_record
from vlmprep.render import MaskPolicy, RenderContext, count_tokens, render_conversation, trained_messages
from vlmprep.journal import JOURNAL_NAME, REJECTS_PARTIAL, Journal, input_signature, landed_ids, load_journal, save_journal
from vlmprep.shards.format import FORMAT_VERSION, sample_key
from vlmprep.shards.writer import ShardInfo, ShardWriter, encode_sample, write_json_atomic
from vlmprep.steps import StepPolicy, split_trace, whole_trace
from vlmprep.truncate import truncate_sample
from vlmprep.types import RawRecord, RecordError, RenderedSample, UserError, deterministic_message


class BuildError(UserError):
    """A fatal, user-facing build fault (bad option, --strict reject): one clear line."""


class Renderer:
    """Everything one process needs to turn a RawRecord into a RenderedSample, exactly as `build` does.
    Also used by `vlmprep inspect` on raw input, so what a person sees is what build writes."""

    def __init__(self, cfg: BuildConfig, processor, *, saved: bool = False):
        """saved: `processor` is a dataset's saved copy, which already carries --chat-template and --min/--max-pixels
        (see renderer_from_saved), so neither is applied again."""
        self.cfg = cfg
        self.processor = processor
        if cfg.chat_template is not None and not saved:
            # Set on the processor itself, so the copy saved into the dataset carries the template that rendered it.
            template = Path(cfg.chat_template).read_text(encoding="utf-8")
            processor.chat_template = template
            if getattr(processor.tokenizer, "chat_template", None) is not None:
                processor.tokenizer.chat_template = template
        # vlmprep truncates to --seq-len itself (never inside an image); the tokenizer's "longer than the
        # specified maximum" warning about the untruncated render is noise. Mark it shown instead of changing
        # model_max_length, so the processor copy saved with the shards stays byte-identical.
        warned = getattr(processor.tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True
        policy = MaskPolicy(train_on_roles=frozenset(cfg.train_on_roles), train_on_eos=cfg.train_on_eos,
                            last_turn_only=cfg.last_turn_only, tool_calls=cfg.tool_calls)
        self.ctx = RenderContext(processor, policy=policy, role_boundaries=cfg.role_boundaries)
        self.norm = NormalizeOptions(image_root=cfg.image_root, allow_remote=cfg.allow_remote,
                                     max_images_per_record=cfg.max_images_per_record)
        if not saved:
            apply_pixel_budget(processor, self.ctx.family, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
        self.steps = StepPolicy(long_traces=cfg.long_traces, keep_images=cfg.keep_images,
                                dropped_image_text=cfg.dropped_image_text)
        self.turns: collections.Counter = collections.Counter()
        self.lost: list[int] = []

    def render(self, raw: RawRecord) -> list[RenderedSample]:
        """parse -> normalize -> prepare images -> history/split (steps.py) -> render + mask -> truncate; raises
        RecordError. One sample per record, or several when --long-traces split cuts a long trace; `self.turns`
        then holds the record's turn accounting and `self.lost` the trained turns that could not fit."""
        self.turns, self.lost = collections.Counter(), []
        conv = normalize_record(parse_record(raw), raw.source, self.norm)
        assistant = {i for i, m in enumerate(conv.messages) if m.role == "assistant"}
        self.turns["input_assistant_turns"] = len(assistant)
        try:
            images = [prepare_image(im, self.processor, self.ctx.family, max_pixels=self.cfg.max_image_pixels,
                                    min_side=self.cfg.min_image_side) for im in conv.images]
            whole = whole_trace(conv, self.steps)
            steps = [whole]
            if self.cfg.long_traces == "split" and count_tokens(whole.conv, self.ctx, _pick(images, whole)) > self.cfg.seq_len:
                steps, self.lost = split_trace(conv, trained_messages(conv, self.ctx.policy), self.steps,
                                               lambda sc: count_tokens(sc.conv, self.ctx, _pick(images, sc)),
                                               self.cfg.seq_len)
            samples = []
            for sc in steps:
                full = render_conversation(sc.conv, self.ctx, _pick(images, sc))
                sample = truncate_sample(full, self.cfg.seq_len)
                before = {sc.source_messages[m] for m, _, _ in full.turn_spans}
                after = {sc.source_messages[m] for m, _, _ in sample.turn_spans}
                self.turns["trained_assistant_turns"] += len(after & assistant)
                self.turns["turns_lost_truncated"] += len((before - after) & assistant)
                self.turns["images_removed_by_history"] += len(sc.removed_images)
                if sc.split is not None and sc.split > 0 and sample.turn_spans:
                    self.turns["context_tokens_repeated"] += sample.turn_spans[0][1]
                samples.append(dataclasses.replace(
                    sample, id=conv.id if sc.split is None else f"{conv.id}#{sc.split}",
                    source_messages=sc.source_messages, trains=sorted(after), removed_images=sc.removed_images,
                    split=sc.split))
        except RecordError:
            self.turns["turns_lost_rejected"] = len(assistant)
            raise
        self.turns["turns_lost_too_long"] = len(set(self.lost) & assistant)
        self.turns["turns_lost_policy"] = (len(assistant) - self.turns["trained_assistant_turns"]
                                           - self.turns["turns_lost_truncated"] - self.turns["turns_lost_too_long"])
        return samples

    def lost_turn_entry(self, raw: RawRecord, message: int) -> dict:
        return reject_entry(raw, "turn_too_long", f"messages[{message}]: this turn does not fit --seq-len "
                            f"{self.cfg.seq_len} even with only the system message and the task as context")

    def process(self, raw: RawRecord):
        """Returns (outcomes, turn accounting): outcomes are ("ok", ShardSample) per sample and ("reject", entry) per
        rejected record or lost turn, in order; never raises for a bad record."""
        self.turns = collections.Counter()
        try:
            samples = self.render(raw)
            outcomes = []
            for sample in samples:
                outcomes.append(("ok", encode_sample(sample, key=sample_key(raw.position, sample.split),
                                                     image_format=self.cfg.image_format,
                                                     zstd_level=self.cfg.zstd_level)))
            outcomes += [("reject", self.lost_turn_entry(raw, i)) for i in self.lost]
            return outcomes, dict(self.turns)
        except RecordError as e:
            reason, message = e.reason, e.message
        except Exception as e:  # noqa: BLE001 - a bad record must never stop the build; counted loudly instead
            reason, message = "internal_error", deterministic_message(f"{type(e).__name__}: {str(e)[:300]}")
        return [("reject", reject_entry(raw, reason, message))], dict(self.turns)


def _pick(images: list, sc) -> list:
    """The prepared images a step conversation keeps (all of them when sc is None)."""
    return images if sc is None else [images[k] for k in sc.images]


def reject_entry(raw: RawRecord, reason: str, message: str) -> dict:
    rid = None
    if raw.text is not None or raw.data is not None:
        try:
            v = parse_record(raw).get("id")
            rid = v if isinstance(v, (str, int)) else None
        except RecordError:
            pass
    return {"source": {"file": raw.source.file, "line": raw.source.line}, "id": rid, "reason": reason,
            "message": message}


_RENDERER: Renderer | None = None
# Most of a worker's start-up is importing these (torch + torchvision + transformers: ~7 s of CPU). Workers fork from
# a forkserver that imported them once, instead of each spawned worker importing them again. Forking the server is
# safe where forking the build process is not: it never ran torch, tokenizers or jinja, it only imported them.
_WORKER_PRELOAD = ["vlmprep.pipeline", "vlmprep.images", "torch", "torchvision",
                   "transformers.models.auto.processing_auto", "transformers.tokenization_mistral_common"]


def _worker_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_WORKER_PRELOAD)  # no effect once the server runs: it already has them
    return ctx


def start_worker_server(cfg: BuildConfig) -> None:
    """With --workers > 1, start the forkserver's imports now, in the background, so they overlap the main process's
    own set-up (load + save the processor) instead of following it. Does not wait."""
    if cfg.workers > 1:
        from multiprocessing import forkserver

        _worker_context()
        forkserver.ensure_running()


def renderer_from_saved(cfg: BuildConfig, processor_dir: str | Path) -> Renderer:
    """The one way a worker of any kind (pool, task, Ray) gets ready: the dataset's saved processor dir, which carries
    the chat template and pixel budget that rendered it, so the --chat-template file need not exist where it runs."""
    import torch

    torch.set_num_threads(1)  # one core per worker: N workers scale instead of oversubscribing
    return Renderer(cfg, load_saved_processor(processor_dir), saved=True)


def _init_worker(cfg: BuildConfig, processor_dir: str) -> None:
    global _RENDERER
    _RENDERER = renderer_from_saved(cfg, processor_dir)


def process_record(raw: RawRecord):
    return _RENDERER.process(raw)


@dataclass
class BuildResult:
    out: Path
    manifest: dict
    rejects: collections.Counter = field(default_factory=collections.Counter)


def _ordered_results(cfg: BuildConfig, records, processor_dir: Path, processor):
    """Yield (position, result) in input order with a bounded read-ahead window (constant memory)."""
    if cfg.workers == 1:  # in-process, reusing the loaded processor: one copy of the tokenizer in memory
        renderer = Renderer(cfg, processor)
        for raw in records:
            yield raw.position, renderer.process(raw)
        return
    window = collections.deque()
    with _worker_context().Pool(cfg.workers, initializer=_init_worker, initargs=(cfg, str(processor_dir))) as pool:
        for raw in records:
            window.append((raw.position, pool.apply_async(process_record, (raw,))))
            if len(window) >= cfg.workers * 4:
                pos, res = window.popleft()
                yield pos, res.get()
        while window:
            pos, res = window.popleft()
            yield pos, res.get()


def _progress(cfg: BuildConfig):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]build"), BarColumn(), TextColumn("{task.completed} records"),
                    TextColumn("{task.fields[rate]:.1f} rec/s"), TextColumn("{task.fields[samples]} samples"),
                    TextColumn("{task.fields[rejects]} rejects"), TimeElapsedColumn(),
                    disable=not cfg.progress, transient=False, console=None)


TOTAL_KEYS = ("records", "samples", "rejected", "tokens", "trainable_tokens", "image_tokens", "images",
              "truncated_samples", "dropped_images", "unrendered_tool_call_turns", "split_samples",
              "input_assistant_turns", "trained_assistant_turns", "turns_lost_truncated", "turns_lost_too_long",
              "turns_lost_policy", "turns_lost_rejected", "images_removed_by_history", "context_tokens_repeated")


def _start_or_resume(out: Path, identity: dict) -> Journal:
    """Resume a matching interrupted build, or clear every trace of an older dataset and start fresh."""
    journal = load_journal(out, identity)
    stale = [p for p in out.glob("*.tmp")]
    if journal is None:
        journal = Journal(identity=identity)
        stale += list(out.glob("shard-*.tar")) + [out / n for n in ("manifest.json", "rejects.jsonl",
                                                                   REJECTS_PARTIAL, JOURNAL_NAME)]
    else:
        done = {s["name"] for s in journal.shards}
        stale += [p for p in out.glob("shard-*.tar") if p.name not in done]
    for p in stale:
        if p.exists():
            p.unlink()
    partial = out / REJECTS_PARTIAL
    with open(partial, "a+b") as f:  # drop rejects written after the last durable point
        f.truncate(journal.rejects_bytes)
    return journal


def build(cfg: BuildConfig) -> BuildResult:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    files = expand_inputs(cfg.inputs)
    start_worker_server(cfg)
    processor = load_processor(cfg.processor)
    Renderer(cfg, processor)  # fail fast on an unsupported processor or policy, before any worker starts
    processor_dir = out / "processor"
    fingerprint = save_processor(processor, processor_dir)
    identity = {"format_version": FORMAT_VERSION, "vlmprep_version": __version__, "config": cfg.to_json(),
                "inputs": input_signature(files), "processor": fingerprint}
    journal = _start_or_resume(out, identity)

    writer = ShardWriter(out, samples_per_shard=cfg.samples_per_shard,
                         shard_size_bytes=int(cfg.shard_size_mb * 1024 * 1024),
                         done=[ShardInfo(**s) for s in journal.shards])
    rejects = collections.Counter(journal.rejects)
    totals = collections.Counter(journal.totals)
    seen_ids = landed_ids(out, journal.shards)
    records = (r for r in iter_records(files, max_line_bytes=cfg.max_line_bytes, max_zstd_window=cfg.max_zstd_window)
               if r.position >= journal.next_position)
    t0 = time.monotonic()
    with open(out / REJECTS_PARTIAL, "a", encoding="utf-8") as rej, _progress(cfg) as progress:
        task = progress.add_task("build", total=None, rate=0.0, samples=totals["samples"], rejects=totals["rejected"])

        def checkpoint(next_position: int) -> None:
            rej.flush()
            os.fsync(rej.fileno())
            journal.shards = [s.to_json() for s in writer.shards]
            journal.next_position = next_position
            journal.rejects_bytes = rej.tell()
            journal.totals = dict(totals)
            journal.rejects = dict(rejects)
            save_journal(out, journal)

        for pos, (outcomes, turns) in _ordered_results(cfg, records, processor_dir, processor):
            totals["records"] += 1
            totals.update(turns)
            completed = False
            for status, payload in outcomes:
                if status == "ok" and payload.meta["id"] in seen_ids:
                    status, payload = "reject", {**_reject_of(payload), "reason": "duplicate_id",
                                                 "message": f"id {payload.meta['id']!r} already used by an earlier record"}
                if status == "ok":
                    seen_ids.add(payload.meta["id"])
                    m = payload.meta
                    totals["samples"] += 1
                    totals["tokens"] += m["num_tokens"]
                    totals["trainable_tokens"] += m["num_trainable_tokens"]
                    totals["image_tokens"] += m["num_image_tokens"]
                    totals["images"] += m["num_images"]
                    totals["truncated_samples"] += int(m["truncated"])
                    totals["dropped_images"] += m["dropped_images"]
                    totals["unrendered_tool_call_turns"] += m["unrendered_tool_calls"]
                    totals["split_samples"] += int(m["split"] is not None)
                    completed |= writer.write(payload)
                else:
                    rejects[payload["reason"]] += 1
                    totals["rejected"] += 1
                    rej.write(json.dumps(payload, ensure_ascii=False, sort_keys=True) + "\n")
                    if cfg.strict:
                        raise BuildError(f"--strict: {payload['source']['file']}:{payload['source']['line']}: "
                                         f"{payload['reason']}: {payload['message']}")
            if completed:  # a shard closed inside this record: the journal's durable point is the record's end
                writer.finish_shard()
                checkpoint(pos + 1)
            elapsed = max(time.monotonic() - t0, 1e-9)
            progress.update(task, advance=1, rate=totals["records"] / elapsed, samples=totals["samples"],
                            rejects=totals["rejected"])
        writer.close()
        checkpoint(1 << 62)  # everything consumed: a kill from here on resumes straight to the manifest
    os.replace(out / REJECTS_PARTIAL, out / "rejects.jsonl")

    manifest = {
        "format_version": FORMAT_VERSION,
        "vlmprep_version": __version__,
        "processor": {"spec": cfg.processor, "class": type(processor).__name__, "fingerprint": fingerprint,
                      "dir": "processor"},
        "config": cfg.to_json(),
        "image_format": cfg.image_format,
        "inputs": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
        "shards": [s.to_json() for s in writer.shards],
        "totals": {k: int(totals[k]) for k in TOTAL_KEYS},
        "turns": turn_coverage(totals),
        "rejects": dict(sorted(rejects.items())),
    }
    write_energon_meta(out)  # .nv-meta/dataset.yaml: Megatron-Energon reads DIR through vlmprep/clients/energon.py
    write_json_atomic(out / "manifest.json", manifest)  # last but the journal: its presence means complete
    (out / JOURNAL_NAME).unlink()
    if totals["samples"] == 0 and not cfg.allow_empty:
        # Complete (manifest and rejects.jsonl are there to look at), but almost surely not what was meant.
        why = ", ".join(f"{r} {n}" for r, n in sorted(rejects.items(), key=lambda x: (-x[1], x[0]))) or "no records"
        raise BuildError(f"{out}: 0 samples written from {totals['records']} records ({why}); see "
                         f"{out / 'rejects.jsonl'}, or pass --allow-empty")
    return BuildResult(out=out, manifest=manifest, rejects=rejects)


def turn_coverage(totals) -> dict:
    """Assistant turns of the input that the shards train, and where the others went."""
    n = int(totals["input_assistant_turns"])
    return {"input_assistant_turns": n, "trained_assistant_turns": int(totals["trained_assistant_turns"]),
            "coverage": round(totals["trained_assistant_turns"] / n, 6) if n else 1.0,
            "lost": {"truncated": int(totals["turns_lost_truncated"]), "turn_too_long": int(totals["turns_lost_too_long"]),
                     "not_trained_by_policy": int(totals["turns_lost_policy"]),
                     "record_rejected": int(totals["turns_lost_rejected"])},
            "images_removed_by_history": int(totals["images_removed_by_history"]),
            "context_tokens_repeated": int(totals["context_tokens_repeated"])}


def _reject_of(sample) -> dict:
    m = sample.meta
    return {"source": dict(m["source"]), "id": m["id"]}
