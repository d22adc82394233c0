"""Inspect: a built dataset dir (read safely, nothing unpickled) or raw input (rendered as build would)
-> selected samples -> a view of exactly what is trained: terminal (rich or plain text) or HTML via report.py.
"""
from __future__ import annotations

import dataclasses
import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from vlmprep.shards import FORMAT_VERSION
from vlmprep.types import RecordError, UserError

ONLY = ("truncated", "rejected")
DEFAULT_LIMIT = 3
_ARRAYS = ("input_ids", "loss_mask", "mm_token_type_ids", "position_ids", "image_grid_thw")
# Every member a vlmprep shard may hold; anything else (.pyd, .pth, .pickle, ...) is refused unread.
_MEMBER_RE = re.compile(r"^(?:(?:%s)\.npy|json|img\d{3}\.(?:npy\.zst|png|webp|orig\.[a-z0-9]{1,8}))$"
                        % "|".join(_ARRAYS))
# Tokens that open a chat turn, per template family: "next" = the role is the first word after the token;
# anything else is the role itself.
_TURN_STARTS = {"<|im_start|>": "next", "<|start_header_id|>": "next", "<|header_start|>": "next",
                "<start_of_turn>": "next", "<|system|>": "system", "<|user|>": "user", "<|assistant|>": "assistant",
                "<|observation|>": "tool", "[INST]": "user", "[/INST]": "assistant"}

class InspectError(UserError):
    """A user-facing inspect fault (bad selection, unsafe or malformed shard member): one line."""


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    path: str
    index: int | None = None  # input position (= shard key), the same number in raw and dir mode
    id: str | None = None
    shard: str | None = None
    limit: int = DEFAULT_LIMIT
    only: str | None = None
    tokens: bool = False
    html: str | None = None
    # Raw input only: build options that change what a record renders to. None = not given: the value from
    # `like` (a built dir whose resolved config and saved processor are reused), else build's default.
    like: str | None = None
    processor: str | None = None
    seq_len: int | None = None
    train_on_roles: tuple[str, ...] | None = None
    train_on_eos: str | None = None
    last_turn_only: bool | None = None
    tool_calls: str | None = None
    chat_template: str | None = None
    role_boundaries: str | None = None
    image_root: str | None = None
    allow_remote: bool | None = None

    def __post_init__(self):
        if self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1")
        if self.index is not None and self.index < 0:
            raise ValueError(f"index={self.index}: must be >= 0 (the record's 0-based input position)")
        if self.only is not None and self.only not in ONLY:
            raise ValueError(f"only={self.only!r}: choose one of {', '.join(ONLY)}")
        if self.only == "rejected" and self.tokens:
            raise ValueError("--tokens shows samples; it cannot be combined with --only rejected")


@dataclass
class InspectedSample:
    """One sample as stored (dir mode) or as build would store it (raw mode); facts come from the arrays."""

    key: str  # 10-digit input position, as in the shard
    id: str
    source: tuple[str, int]  # file, line
    where: str  # shard name, or "rendered from input"
    input_ids: np.ndarray
    loss_mask: np.ndarray
    mm_token_type_ids: np.ndarray
    image_grid_thw: np.ndarray  # [N, 3]
    images: list[Callable[[], np.ndarray]]  # per occurrence: uint8 HxWx3, decoded only when a view needs it
    num_tokens_before_truncation: int
    truncated: bool
    dropped_images: int
    unrendered_tool_calls: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass
class Segment:
    """Tokens [start, end) shown as one piece: a text run, one special token, or one collapsed image run."""

    start: int
    end: int
    kind: str  # "text" | "special" | "image"
    trained: bool
    text: str
    image: int | None = None  # 0-based image occurrence for kind == "image"


@dataclass
class MessageView:
    role: str
    segments: list[Segment]

    @property
    def runs(self) -> list[tuple[bool, list[Segment]]]:
        """Maximal runs of equal loss mask: what the trained markers wrap."""
        out: list[tuple[bool, list[Segment]]] = []
        for seg in self.segments:
            if out and out[-1][0] == seg.trained:
                out[-1][1].append(seg)
            else:
                out.append((seg.trained, [seg]))
        return out

    @property
    def num_trained(self) -> int:
        return sum(s.end - s.start for s in self.segments if s.trained)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.segments)


@dataclass
class SampleView:
    sample: InspectedSample
    messages: list[MessageView]
    tokenizer_view: "TokenizerView"

    @property
    def num_tokens(self) -> int:
        return len(self.sample.input_ids)

    @property
    def num_trained(self) -> int:
        return int(self.sample.loss_mask.sum())

    @property
    def num_image_tokens(self) -> int:
        return int((self.sample.mm_token_type_ids != 0).sum())

    @property
    def num_images(self) -> int:
        return len(self.sample.image_grid_thw)


class TokenizerView:
    """What the views need from a processor: decode, special tokens, turn starts and the image merge size."""

    def __init__(self, *, decode: Callable[[list[int]], str], decode_batch: Callable[[list[list[int]]], list[str]],
                 special: dict[int, str], merge_size: int | None):
        self._decode = decode
        self._decode_batch = decode_batch
        self.special = special
        self.special_ids = np.array(sorted(special), dtype=np.int64)
        self.turn_starts = {i: _TURN_STARTS[c] for i, c in special.items() if c in _TURN_STARTS}
        self.merge_size = merge_size  # None: the family has no patch grid to check placeholder counts against

    @classmethod
    def from_processor(cls, processor) -> "TokenizerView":
        tok = processor.tokenizer
        kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
        return cls(decode=lambda ids: tok.decode(ids, **kw), decode_batch=lambda b: tok.batch_decode(b, **kw),
                   special={int(i): t.content for i, t in tok.added_tokens_decoder.items() if t.special},
                   merge_size=getattr(getattr(processor, "image_processor", None), "merge_size", None))

    @classmethod
    def from_dir(cls, d: Path) -> "TokenizerView":
        """A dataset's saved processor. Its tokenizer.json alone decodes exactly as the HF tokenizer does
        (decode is the Rust decoder either way) and skips seconds of transformers import per call."""
        merge = None
        for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
            if (d / name).is_file():
                cfg = json.loads((d / name).read_text(encoding="utf-8"))
                merge = (cfg.get(key) or {}).get("merge_size") if key else cfg.get("merge_size")
                if merge:
                    break
        if not (d / "tokenizer.json").is_file():
            from transformers import AutoProcessor

            return cls.from_processor(AutoProcessor.from_pretrained(str(d), local_files_only=True))
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        return cls(decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
                   decode_batch=lambda b: tok.decode_batch(b, skip_special_tokens=False),
                   special={int(i): t.content for i, t in tok.get_added_tokens_decoder().items() if t.special},
                   merge_size=int(merge) if merge else None)

    def decode(self, ids) -> str:
        return self._decode([int(i) for i in ids])

    def pieces(self, ids: np.ndarray) -> list[str]:
        """Each token's own text, in one batched call."""
        return self._decode_batch([[int(i)] for i in ids])



def _load_npy(data: bytes, where: str) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:  # object arrays need pickle: refused, never executed
        raise InspectError(f"{where}: not a plain numeric .npy ({e}); refusing to unpickle it") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iub":
        raise InspectError(f"{where}: unexpected dtype {getattr(arr, 'dtype', type(arr))}, expected integers")
    return arr


@dataclass
class TarSample:
    """Members of one sample in a shard, read on demand (images and arrays of unselected samples stay unread)."""

    shard: str
    key: str
    members: dict[str, tarfile.TarInfo]
    tar: tarfile.TarFile

    def read(self, ext: str) -> bytes:
        if ext not in self.members:
            raise InspectError(f"{self.shard}: sample {self.key} has no member {ext!r}")
        return self.tar.extractfile(self.members[ext]).read()

    def meta(self) -> dict:
        try:
            meta = json.loads(self.read("json"))
        except ValueError as e:
            raise InspectError(f"{self.shard}: {self.key}.json is not valid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise InspectError(f"{self.shard}: {self.key}.json is not a JSON object")
        return meta

    def array(self, name: str) -> np.ndarray:
        return _load_npy(self.read(f"{name}.npy"), f"{self.shard}: {self.key}.{name}.npy")


def iter_tar_samples(path: Path) -> Iterator[TarSample]:
    """Group a shard's members by key after checking every member name and type; extracts nothing to disk."""
    name = path.name
    with tarfile.open(path, mode="r:") as tar:
        key, members = None, {}
        for m in tar:
            k, _, ext = m.name.partition(".")
            if not m.isreg() or not re.fullmatch(r"\d{10}", k) or not _MEMBER_RE.match(ext):
                raise InspectError(f"{name}: unexpected member {m.name!r} (not a vlmprep shard member); "
                                   "refusing to read it")
            if k != key and key is not None:
                yield TarSample(name, key, members, tar)
                members = {}
            key = k
            members[ext] = m
        if key is not None:
            yield TarSample(name, key, members, tar)


def load_manifest(d: Path) -> dict:
    p = d / "manifest.json"
    if not p.is_file():
        raise InspectError(f"{d} has no manifest.json: not a finished vlmprep build (rerun `vlmprep build`)")
    try:
        manifest = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise InspectError(f"{p} is not valid JSON: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InspectError(f"{p}: format_version {manifest.get('format_version')!r} is not supported "
                           f"(this vlmprep reads {FORMAT_VERSION})")
    return manifest


def shard_paths(d: Path, manifest: dict, shard: str | None = None) -> list[Path]:
    names = [s["name"] for s in manifest.get("shards", [])]
    if shard is not None:
        want = shard if shard.endswith(".tar") else shard + ".tar"
        if want not in names:
            raise InspectError(f"--shard {shard}: no such shard in {d} (have {', '.join(names[:5]) or 'none'}"
                               + (", ..." if len(names) > 5 else "") + ")")
        names = [want]
    for n in names:
        if not (d / n).is_file():
            raise InspectError(f"{d / n} is listed in the manifest but missing")
    return [d / n for n in names]


def _image_loader(ext: str, data: bytes) -> Callable[[], np.ndarray]:
    from vlmprep.images import decode_stored_image

    return lambda: decode_stored_image(ext, data)


def sample_from_tar(ts: TarSample) -> InspectedSample:
    meta = ts.meta()
    arrays = {n: ts.array(n) for n in ("input_ids", "loss_mask", "mm_token_type_ids", "image_grid_thw")}
    ids, mask, types = arrays["input_ids"], arrays["loss_mask"], arrays["mm_token_type_ids"]
    if not (ids.ndim == mask.ndim == types.ndim == 1 and len(ids) == len(mask) == len(types)):
        raise InspectError(f"{ts.shard}: sample {ts.key} has misaligned arrays "
                           f"({ids.shape}, {mask.shape}, {types.shape})")
    grid = arrays["image_grid_thw"].reshape(-1, 3)
    loaders, blobs = [], {}
    for im in meta.get("images", []):
        member = im.get("member", "")
        if member not in blobs:
            blobs[member] = ts.read(member)
        loaders.append(_image_loader(member.partition(".")[2], blobs[member]))
    src = meta.get("source") or {}
    sample = InspectedSample(
        key=ts.key, id=str(meta.get("id")), source=(str(src.get("file")), int(src.get("line", 0))), where=ts.shard,
        input_ids=ids, loss_mask=mask, mm_token_type_ids=types, image_grid_thw=grid, images=loaders,
        num_tokens_before_truncation=int(meta.get("num_tokens_before_truncation", len(ids))),
        truncated=bool(meta.get("truncated", False)), dropped_images=int(meta.get("dropped_images", 0)),
        unrendered_tool_calls=int(meta.get("unrendered_tool_calls", 0)))
    # The view is computed from the arrays; a meta that disagrees with them is a corrupt dataset worth seeing.
    for k, v in (("num_tokens", len(ids)), ("num_trainable_tokens", int(mask.sum())),
                 ("num_image_tokens", int((types != 0).sum())), ("num_images", len(grid))):
        if k in meta and meta[k] != v:
            sample.warnings.append(f"meta {k}={meta[k]} but the arrays give {v}")
    return sample


def _iter_dir(cfg: InspectConfig, d: Path) -> Iterator[InspectedSample | dict]:
    manifest = load_manifest(d)
    if cfg.only == "rejected":
        if cfg.index is not None or cfg.shard is not None:
            raise InspectError("--only rejected on a built dir lists rejects.jsonl, which has no shard or input "
                               "position: select with --id, or inspect the raw input with --index")
        yield from _iter_rejects_file(d, cfg)
        return
    for path in shard_paths(d, manifest, cfg.shard):
        for ts in iter_tar_samples(path):
            if cfg.index is not None and int(ts.key) != cfg.index:
                continue
            if cfg.id is not None or cfg.only == "truncated":
                meta = ts.meta()
                if cfg.id is not None and str(meta.get("id")) != cfg.id:
                    continue
                if cfg.only == "truncated" and not meta.get("truncated"):
                    continue
            yield sample_from_tar(ts)


def _iter_rejects_file(d: Path, cfg: InspectConfig) -> Iterator[dict]:
    p = d / "rejects.jsonl"
    if not p.is_file():
        return
    with open(p, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if cfg.id is not None and str(r.get("id")) != cfg.id:
                continue
            yield r



RAW_OPTIONS = ("processor", "seq_len", "train_on_roles", "train_on_eos", "last_turn_only", "tool_calls",
               "chat_template", "role_boundaries", "image_root", "allow_remote")


def _raw_build_config(cfg: InspectConfig):
    from vlmprep.config import BuildConfig

    kw = {}
    if cfg.like is not None:
        like = Path(cfg.like)
        fields = {f.name for f in dataclasses.fields(BuildConfig)} - {"inputs", "out", "progress", "workers"}
        kw = {k: tuple(v) if isinstance(v, list) else v
              for k, v in (load_manifest(like).get("config") or {}).items() if k in fields}
        # The saved processor is the one that rendered the dataset, chat template included.
        kw.update(processor=str(like / "processor"), chat_template=None)
    kw.update({k: getattr(cfg, k) for k in RAW_OPTIONS if getattr(cfg, k) is not None})
    return BuildConfig(inputs=(cfg.path,), out="", progress=False, **kw)  # out: inspect writes no dataset


def _raw_id_candidate(raw, want: str) -> bool:
    """Cheap pre-filter for --id, mirroring normalize_record's id rule; the rendered id is checked after."""
    from vlmprep.records import parse_record

    if want == f"{Path(raw.source.file).name}:{raw.source.line}":
        return True
    try:
        rid = parse_record(raw).get("id")
    except RecordError:
        return False
    return isinstance(rid, (str, int, float)) and not isinstance(rid, bool) and str(rid) == want


def _sample_from_rendered(s, key: str) -> InspectedSample:
    return InspectedSample(
        key=key, id=s.id, source=(s.source.file, s.source.line), where="rendered from input",
        input_ids=s.input_ids, loss_mask=s.loss_mask, mm_token_type_ids=s.mm_token_type_ids,
        image_grid_thw=np.asarray(s.image_grid_thw).reshape(-1, 3),
        images=[(lambda px=im.pixels: px) for im in s.images],
        num_tokens_before_truncation=s.num_tokens_before_truncation, truncated=s.truncated,
        dropped_images=s.dropped_images, unrendered_tool_calls=s.unrendered_tool_calls)


def _iter_raw(cfg: InspectConfig, renderer) -> Iterator[InspectedSample | dict]:
    from vlmprep.pipeline import reject_entry
    from vlmprep.records import expand_inputs, iter_records
    from vlmprep.shards import sample_key

    bcfg = renderer.cfg
    seen_ids: set[str] = set()
    for raw in iter_records(expand_inputs(bcfg.inputs), max_line_bytes=bcfg.max_line_bytes):
        if cfg.index is not None and raw.position != cfg.index:
            if raw.position > cfg.index:
                return
            continue
        if cfg.id is not None and not _raw_id_candidate(raw, cfg.id):
            continue
        try:
            sample = renderer.render(raw)
        except RecordError as e:
            reject = reject_entry(raw, e.reason, e.message)
        except Exception as e:  # noqa: BLE001 - build counts these as internal_error rejects; so do we
            reject = reject_entry(raw, "internal_error", f"{type(e).__name__}: {str(e)[:300]}")
        else:
            if cfg.id is not None and sample.id != cfg.id:
                continue
            # Build rejects a repeated id; seen only among records rendered here, so exact for a full scan.
            if sample.id in seen_ids:
                reject = {**reject_entry(raw, "duplicate_id", ""), "id": sample.id,
                          "message": f"id {sample.id!r} already used by an earlier record"}
            else:
                seen_ids.add(sample.id)
                if cfg.only == "rejected" or (cfg.only == "truncated" and not sample.truncated):
                    continue
                yield _sample_from_rendered(sample, sample_key(raw.position))
                continue
        if cfg.only in (None, "rejected"):
            yield reject


def select(cfg: InspectConfig) -> tuple[list[InspectedSample | dict], TokenizerView]:
    """The first `limit` matching items in input order: samples, or reject entries (dicts)."""
    p = Path(cfg.path)
    is_dataset = p.is_dir() and ((p / "manifest.json").exists() or any(p.glob("shard-*.tar")))
    if is_dataset:
        passed = ["--" + k.replace("_", "-") for k in ("like",) + RAW_OPTIONS if getattr(cfg, k) is not None]
        if passed:
            raise InspectError(f"{', '.join(passed)}: only for raw input; {p} is a built dataset that carries "
                               "the processor and options it was built with")
        load_manifest(p)
        tv = TokenizerView.from_dir(p / "processor")
        items = _iter_dir(cfg, p)
    else:
        if cfg.shard is not None:
            raise InspectError(f"--shard selects a shard of a built dir; {p} is raw input")
        from vlmprep.pipeline import Renderer
        from vlmprep.processor import load_processor

        bcfg = _raw_build_config(cfg)
        processor = load_processor(bcfg.processor)
        tv = TokenizerView.from_processor(processor)
        items = _iter_raw(cfg, Renderer(bcfg, processor))
    out = []
    for item in items:
        out.append(item)
        if len(out) >= cfg.limit:
            break
    return out, tv



def segment_sample(sample: InspectedSample, tv: TokenizerView) -> list[MessageView]:
    """Split into runs of equal (mask, type), each special token alone; decode each run with one call."""
    ids = np.asarray(sample.input_ids, dtype=np.int64)
    mask = np.asarray(sample.loss_mask).astype(bool)
    types = np.asarray(sample.mm_token_type_ids).astype(np.int64)
    n = len(ids)
    if n == 0:
        return []
    special = np.isin(ids, tv.special_ids) & (types == 0)
    change = np.ones(n, dtype=bool)
    change[1:] = (mask[1:] != mask[:-1]) | (types[1:] != types[:-1]) | special[1:] | special[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], n)
    segments: list[Segment] = []
    k = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        trained = bool(mask[s])
        if types[s] != 0:
            segments.append(Segment(s, e, "image", trained, image_marker(sample, k, e - s, tv), image=k))
            k += 1
        elif special[s]:
            segments.append(Segment(s, e, "special", trained, tv.special[int(ids[s])]))
        else:
            segments.append(Segment(s, e, "text", trained, tv.decode(ids[s:e])))
    if k != len(sample.image_grid_thw):
        sample.warnings.append(f"{k} image placeholder runs but {len(sample.image_grid_thw)} image_grid_thw rows")
    return _split_messages(segments, ids, tv)


def image_marker(sample: InspectedSample, k: int, n_tokens: int, tv: TokenizerView) -> str:
    grid = sample.image_grid_thw
    if k >= len(grid):
        return f"[image {k + 1}: no grid row -> {n_tokens} tokens]"
    t, h, w = (int(x) for x in grid[k])
    patches = f"{h}x{w}" if t == 1 else f"{t}x{h}x{w}"
    expected = None if tv.merge_size is None else t * h * w // (tv.merge_size ** 2)
    bad = "" if expected in (None, n_tokens) else f", grid implies {expected}!"
    return f"[image {k + 1}: {patches} patches -> {n_tokens} tokens{bad}]"


def _split_messages(segments: list[Segment], ids: np.ndarray, tv: TokenizerView) -> list[MessageView]:
    messages: list[MessageView] = []
    cur: list[Segment] = []
    for seg in segments:
        if seg.kind == "special" and int(ids[seg.start]) in tv.turn_starts and cur:
            messages.append(MessageView(_role(cur, ids, tv), cur))
            cur = []
        cur.append(seg)
    if cur:
        messages.append(MessageView(_role(cur, ids, tv), cur))
    return messages


def _role(segs: list[Segment], ids: np.ndarray, tv: TokenizerView) -> str:
    first = segs[0]
    how = tv.turn_starts.get(int(ids[first.start])) if first.kind == "special" else None
    if how == "next":
        words = segs[1].text.split("\n", 1)[0].split() if len(segs) > 1 and segs[1].kind == "text" else []
        return words[0].rstrip(":") if words else "?"
    return how or "(no turn header)"


def view_sample(sample: InspectedSample, tv: TokenizerView) -> SampleView:
    return SampleView(sample, segment_sample(sample, tv), tv)


def header_line(v: SampleView) -> str:
    s = v.sample
    return f"=== sample {s.key}  id {s.id}  ({s.where}) ==="


def message_line(m: MessageView) -> str:
    trained = f" ({m.num_trained}/{m.num_tokens} tokens trained)" if m.num_trained else ""
    return f"--- {m.role}{trained} ---"


def fact_lines(v: SampleView) -> list[str]:
    s = v.sample
    ratio = v.num_trained / max(v.num_tokens, 1)
    if s.truncated:
        dropped = f"{s.dropped_images} image{'s' if s.dropped_images != 1 else ''} dropped by the cut"
        trunc = f"truncated: yes, {s.num_tokens_before_truncation} -> {v.num_tokens} tokens, {dropped}"
    else:
        trunc = "truncated: no"
    lines = [f"tokens {v.num_tokens} | trained {v.num_trained} ({ratio:.1%}) | image tokens {v.num_image_tokens}"
             f" | images {v.num_images}",
             f"{trunc} | source {s.source[0]}:{s.source[1]}"]
    if s.unrendered_tool_calls:
        lines.append(f"note: {s.unrendered_tool_calls} turn(s) with tool_calls that the chat template does not "
                     "render, so the model never sees them (build --tool-calls)")
    lines += [f"WARNING: {w}" for w in s.warnings]
    return lines


def reject_line(r: dict) -> str:
    src = r.get("source") or {}
    rid = f"  id {r['id']}" if r.get("id") is not None else ""
    return f"rejected  {src.get('file')}:{src.get('line')}{rid}  {r.get('reason')}: {r.get('message')}"


def format_plain(v: SampleView) -> str:
    """Plain text: the conversation with [T]...[/T] around each trained run, then the facts."""
    out = [header_line(v)]
    for m in v.messages:
        body = []
        for trained, segs in m.runs:
            text = "".join(seg.text for seg in segs)
            body.append(f"[T]{text}[/T]" if trained else text)
        out.append(message_line(m))
        out.append("".join(body).removesuffix("\n"))
    out += fact_lines(v)
    return "\n".join(out) + "\n"


_STYLE = {"text": "dim", "special": "bold magenta", "image": "bold cyan"}
_TRAINED = "black on green"


def format_rich(v: SampleView):
    """The same view as rich Text: trained tokens on green, masked text dim, special tokens and images bold."""
    from rich.text import Text

    t = Text()
    t.append(header_line(v) + "\n", style="bold")
    for m in v.messages:
        t.append(message_line(m) + "\n", style="bold blue")
        for seg in m.segments:
            style = _STYLE[seg.kind]
            if seg.trained:
                style = _TRAINED if seg.kind == "text" else f"{style} {_TRAINED}"
            t.append(seg.text, style=style)
        if m.segments and not m.segments[-1].text.endswith("\n"):
            t.append("\n")
    for line in fact_lines(v):
        t.append(line + "\n", style="yellow" if line.startswith(("WARNING", "note")) else "")
    return t


def token_rows(v: SampleView) -> list[tuple[str, str, str, str, str]]:
    """(index, id, mask, type, piece) per token; each image run is one row, as in the conversation view."""
    s = v.sample
    text_idx = np.flatnonzero(np.asarray(s.mm_token_type_ids) == 0)
    pieces = dict(zip(text_idx.tolist(), v.tokenizer_view.pieces(np.asarray(s.input_ids)[text_idx])))
    rows = []
    for m in v.messages:
        for seg in m.segments:
            if seg.kind == "image":
                rows.append((f"{seg.start}-{seg.end - 1}", str(int(s.input_ids[seg.start])), str(int(seg.trained)),
                             str(int(s.mm_token_type_ids[seg.start])), seg.text))
                continue
            for i in range(seg.start, seg.end):
                rows.append((str(i), str(int(s.input_ids[i])), str(int(s.loss_mask[i])),
                             str(int(s.mm_token_type_ids[i])), repr(pieces[i])))
    return rows


_TOKEN_COLUMNS = ("index", "id", "mask", "type", "piece")


def _token_table(rows: list[tuple[str, ...]]) -> list[str]:
    w = [max([len(c)] + [len(r[j]) for r in rows]) for j, c in enumerate(_TOKEN_COLUMNS[:4])]
    head = "  ".join(c.rjust(w[j]) for j, c in enumerate(_TOKEN_COLUMNS[:4])) + "  piece"
    return [head] + ["  ".join(r[j].rjust(w[j]) for j in range(4)) + "  " + r[4] for r in rows]


def format_tokens_plain(v: SampleView) -> str:
    return "\n".join([header_line(v)] + _token_table(token_rows(v)) + fact_lines(v)) + "\n"


def format_tokens_rich(v: SampleView):
    # Styled lines rather than a rich Table: a Table lays out 30k rows in seconds, lines in milliseconds.
    from rich.text import Text

    rows = token_rows(v)
    lines = _token_table(rows)
    t = Text()
    t.append(header_line(v) + "\n", style="bold")
    t.append(lines[0] + "\n", style="bold")
    for r, line in zip(rows, lines[1:]):
        t.append(line + "\n", style=_TRAINED if r[2] == "1" else ("bold cyan" if r[3] != "0" else "dim"))
    t.append("\n".join(fact_lines(v)) + "\n")
    return t


@dataclass
class InspectResult:
    samples: list[SampleView]
    rejects: list[dict]
    html: str | None = None


def run_inspect(cfg: InspectConfig, console=None) -> InspectResult:
    """Select, view and print (or write the HTML report); raises InspectError when no sample matches."""
    from rich.console import Console

    console = console or Console(highlight=False)
    items, tv = select(cfg)
    if not items and cfg.only != "rejected":
        what = [f"{k} {v}" for k, v in (("--index", cfg.index), ("--id", cfg.id), ("--shard", cfg.shard),
                                         ("--only", cfg.only)) if v is not None]
        raise InspectError(f"no sample in {cfg.path} matches {' '.join(what) or 'the selection'}")
    views = [view_sample(x, tv) if isinstance(x, InspectedSample) else x for x in items]
    result = InspectResult([v for v in views if isinstance(v, SampleView)], [v for v in views if isinstance(v, dict)])
    if cfg.html:
        from vlmprep.report import write_report

        write_report(Path(cfg.html), result.samples, result.rejects, title=f"vlmprep inspect {cfg.path}")
        result.html = cfg.html
        console.print(f"wrote {cfg.html}: {len(result.samples)} samples, {len(result.rejects)} rejects",
                      markup=False, highlight=False, soft_wrap=True)
        return result
    if not views:
        console.print(f"no rejected records in {cfg.path}", markup=False, highlight=False, soft_wrap=True)
    plain = not console.is_terminal
    for v in views:
        if isinstance(v, dict):
            console.print(reject_line(v), markup=False, highlight=False, soft_wrap=True)
        elif plain:
            console.out(format_tokens_plain(v) if cfg.tokens else format_plain(v), end="", highlight=False)
        else:
            console.print(format_tokens_rich(v) if cfg.tokens else format_rich(v))
    return result
