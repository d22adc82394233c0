"""What every reader of a dataset refuses before it reads or allocates (shard_format.schema.json `reader_limits`),
and JSON text from a dataset -> its value within them. vlmprep and the trainer both use it: a dataset from
someone else is untrusted input, and json.loads alone recurses (200,000 nested brackets are a RecursionError).
"""

from __future__ import annotations

import functools
import io
import json
import math
import re
from dataclasses import dataclass

import numpy as np

from vlmprep_schemas import load


@dataclass(frozen=True)
class ReaderLimits:
    """Bytes and depths a reader accepts; the schema's reader_limits says what each bounds."""

    member_bytes: int
    meta_bytes: int
    manifest_bytes: int
    json_depth: int
    image_bytes: int
    sample_bytes: int
    patch_pixels: int


LIMITS = ReaderLimits(
    **{k: v for k, v in load("shard_format.schema.json")["reader_limits"].items() if k != "description"}
)
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')  # deleted before brackets are counted


def json_depth(text: str | bytes, limit: int = LIMITS.json_depth) -> int:
    """How deep [ and { nest in JSON text (strings skipped), counted without parsing it: escaped backslashes and
    quotes dropped, then everything but quotes and brackets, then what lies between quotes (strings); in
    C-speed passes over the text (a 10^4-shard manifest), where a parser would see the same strings up to its first
    syntax error. Text with no more brackets than `limit` is not scanned: its bracket count, an upper bound, is
    returned (exact above `limit`)."""
    data = text if isinstance(text, bytes) else None
    opened = data.count(b"[") + data.count(b"{") if data is not None else text.count("[") + text.count("{")
    if opened <= limit:  # the common case, a small meta: no deeper than its brackets
        return opened
    data = data if data is not None else text.encode("utf-8", "surrogatepass")
    kept = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    chars = np.frombuffer(kept, np.uint8)
    quote = chars == ord('"')
    brackets = chars[~quote & (np.cumsum(quote, dtype=np.int64) % 2 == 0)]  # outside strings
    if not len(brackets):
        return 0
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1), dtype=np.int64).max())


def load_json(data: bytes, what: str, max_bytes: int):
    """UTF-8 JSON from a dataset -> its value. ValueError, one line naming `what`, for more than max_bytes, bytes
    that are not UTF-8, nesting deeper than LIMITS.json_depth (all found before parsing) or text that is not JSON."""
    if len(data) > max_bytes:
        raise ValueError(f"{what} is {len(data)} bytes, more than a reader accepts ({max_bytes})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None
    depth = json_depth(text)
    if depth > LIMITS.json_depth:
        raise ValueError(f"{what} nests {depth} levels deep, more than a reader accepts ({LIMITS.json_depth})")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def grid_problem(height: int, width: int, row, patch: int, *, frames: bool = False) -> str | None:
    """Why an image stored at `height` x `width` pixels (the meta's, what bounds its decode) is not what its grid row
    `row` (t, h, w) makes on `patch`-pixel patches (1: a family whose grid rows are the stored size itself), or None.
    An image's t is 1; a video's frames (`frames`) have any t (checked against their count elsewhere)."""
    t, gh, gw = (int(x) for x in row)
    if not 0 < patch <= LIMITS.patch_pixels:
        return (
            f"is {width}x{height} on grid {[t, gh, gw]}: patches of {patch} pixels, not 1 to "
            f"{LIMITS.patch_pixels} as a reader accepts"
        )
    if (t != 1 and not frames) or (height, width) != (gh * patch, gw * patch):
        return (
            f"is {width}x{height}, but the sample stores grid {[t, gh, gw]} ({gw * patch}x{gh * patch} in "
            f"{patch}-pixel patches)"
        )
    return None


def check_grid_sizes(sizes, rows, *, patch: int | None = None, frames: bool = False) -> None:
    """A sample's images (or its videos' frames): each (height, width) of `sizes` must be its row of `rows`
    (image_grid_thw or video_grid_thw) times one patch size, the processor's `patch` where the reader knows it, else
    the one the first of them gives, for all of them (grid_problem). What every reader checks before it decodes one:
    a size its grid does not make is refused unread. ValueError, one line naming the image (or video) by its place
    in token order."""
    for k, ((height, width), row) in enumerate(zip(sizes, rows)):
        if patch is None:  # a reader without the processor: one p for the sample, at most LIMITS.patch_pixels
            patch = height // int(row[1]) if int(row[1]) > 0 else 0
        problem = grid_problem(height, width, row, patch, frames=frames)
        if problem:
            raise ValueError(f"{'video' if frames else 'image'} {k} {problem}")


# The header np.save writes (keys sorted, shape as a tuple repr), matched instead of running numpy's own parser
# (tokenize + literal_eval) on bytes from a dataset: it raises more than ValueError on a damaged header.
_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER = re.compile(
    r"\{'descr': '([^']{1,32})', 'fortran_order': (False|True), "
    r"'shape': \(((?:[0-9]{1,20}, )*[0-9]{0,20},?)\), \} *\n"
)


# Headers npy_header parsed (the header's bytes -> descr, Fortran order, shape): a loader reads the same few headers
# (one per array and sequence length) at every sample, and the regex and int parse were ~3% of its time.
_NPY_PARSED: dict[bytes, tuple[str, bool, tuple[int, ...]]] = {}


def npy_header(data: bytes, name: str) -> tuple[str, bool, tuple[int, ...], int]:
    """A .npy member's declared descr (dtype string), Fortran order and shape, and where its data starts, from its
    header alone; ValueError (one line naming `name`) when it is not the header np.save writes."""
    if data[:6] != _NPY_MAGIC or data[6:8] not in (b"\x01\x00", b"\x02\x00"):
        raise ValueError(f"{name} is not a .npy version 1 or 2 (it starts {data[:8]!r})")
    start = 10 if data[6] == 1 else 12
    end = start + int.from_bytes(data[8:start], "little")
    head = bytes(data[:end]) if end <= 4096 else b""
    if (known := _NPY_PARSED.get(head)) is not None:  # a header parsed before, byte for byte
        return (*known, end)
    match = _NPY_HEADER.fullmatch(data[start : min(end, start + 65536)].decode("latin-1"))
    if end > len(data) or match is None:
        raise ValueError(f"{name} has no .npy header as np.save writes it ({data[start : start + 80].rstrip()!r})")
    shape = tuple(int(d) for d in match.group(3).split(",") if d.strip())
    if head:
        if len(_NPY_PARSED) >= 8192:  # a reader meets a few shapes per sequence length: bounded all the same
            _NPY_PARSED.clear()
        _NPY_PARSED[head] = (match.group(1), match.group(2) == "True", shape)
    return match.group(1), match.group(2) == "True", shape, end


def dtype_name(descr: str) -> str:
    """A .npy descr's dtype name (int64 for '<i8'), or the descr itself when numpy knows none."""
    try:
        return np.dtype(descr).name
    except TypeError:
        return descr


def load_npy(data: bytes, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A .npy member -> its array (a copy), the header checked first: `dtype`, `shape` (what the meta says) and data
    exactly as long as declared, so a header claiming an enormous shape allocates nothing; an object array (a pickle)
    is refused unread. ValueError (one line naming `name`) on any fault."""
    descr, fortran, dims, offset = npy_header(data, name)
    if "O" in descr:
        raise ValueError(
            f"{name} is not a plain numeric .npy (its dtype {descr} holds Python objects, which need "
            "allow_pickle); refusing to unpickle it"
        )
    want = np.dtype(dtype)
    if descr != want.str or len(dims) != len(shape):
        raise ValueError(f"{name} is {dtype_name(descr)} with {len(dims)} dims, expected {want} with {len(shape)}")
    if dims != tuple(shape) or fortran:
        raise ValueError(
            f"{name} declares shape {dims}{' in Fortran order' if fortran else ''}, but its meta needs {tuple(shape)}"
        )
    count = math.prod(dims)
    if len(data) - offset != count * want.itemsize:
        raise ValueError(
            f"{name} holds {len(data) - offset} bytes of data, its header declares {count * want.itemsize}"
        )
    return np.frombuffer(data, want, count=count, offset=offset).reshape(dims).copy()


INDEX_HEADER_BYTES = 4096  # a sample index .npy's header (np.save writes ~256 bytes for its 1-d structured dtype)


def index_bytes_limit(rows: int, dtype) -> int:
    """The most bytes a sample index of `rows` rows of `dtype` may have: what a reader checks (the manifest's size and
    the file's) before it reads one byte of it."""
    return INDEX_HEADER_BYTES + rows * np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=4096)
def npy_head(shape: tuple[int, ...], dtype) -> bytes:
    """The .npy header (format 1.0) np.save writes before a C-order array of `shape` and `dtype`, built once per
    shape and dtype: a sample's array members and stored pixels (the writer) and a sample index (index_head)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def index_head(rows: int, dtype) -> bytes:
    """The .npy header np.save writes before `rows` rows of the structured `dtype`: what a sample index file (a
    shard's sidecar, or the dataset's) starts with."""
    return npy_head((rows,), dtype)


def index_header(head: bytes, size: int, name: str, dtype) -> tuple[int, int]:
    """A sample index .npy's header, from its first bytes `head` and its size: (where its rows start, how many), once
    the header is exactly the one np.save writes for a 1-d array of the structured `dtype` of that many rows (the
    row count the size gives); ValueError (one line naming `name`) otherwise. numpy's own header parser is not run."""
    dtype = np.dtype(dtype)
    if head[:6] != _NPY_MAGIC or head[6:8] not in (b"\x01\x00", b"\x02\x00"):
        raise ValueError(f"{name} is not a .npy version 1 or 2 (it starts {head[:8]!r})")
    start = 10 if head[6] == 1 else 12
    end = start + int.from_bytes(head[8:start], "little")
    if end > min(len(head), size, INDEX_HEADER_BYTES):
        raise ValueError(f"{name} has a .npy header of {end} bytes, more than its data or a reader accepts")
    rows, extra = divmod(size - end, dtype.itemsize)
    want = f"{{'descr': {np.lib.format.dtype_to_descr(dtype)!r}, 'fortran_order': False, 'shape': ({rows},), }}"
    if extra or head[start:end].decode("latin-1").rstrip(" \n") != want:
        raise ValueError(
            f"{name} is not a sample index .npy as np.save writes it: its header is not the one of "
            f"{rows} rows of the index's dtype ({size - end} bytes of data after it)"
        )
    return end, rows


def index_rows(data: bytes, name: str, dtype) -> np.ndarray:
    """A whole sample index .npy (index_header) -> its rows, read-only, with no allocation its header declares."""
    end, rows = index_header(data[:INDEX_HEADER_BYTES], len(data), name, dtype)
    return np.frombuffer(data, np.dtype(dtype), count=rows, offset=end)


_JSON_TYPES = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def schema_problem(value, schema: str, read: tuple = ()) -> str | None:
    """The first place where a sample meta or manifest (`schema`: its file in schemas/, or FILE#/POINTER for a part of
    one, e.g. a task manifest's shard list) has a value of another JSON
    type than the schema gives, a number outside the schema's minimum / maximum (and int64), or lacks a required
    key; None when there is none. Types, bounds and required keys only, which is what readers index and convert
    (`vlmprep verify` checks the whole schema, at a hundred times the cost): the schema is compiled once into a
    checker. `read`: only the fields a reader reads are checked, e.g. ("id", ("images", ("member", "height"))) (a
    nested tuple: a key and the fields read in its object, or in each object of its array); () checks all."""
    problem = _checker(schema, read)(value)
    if problem is None:
        return None
    path, text = problem
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in reversed(path)).lstrip(".")
    return f"{where or 'it'} {text}"


@functools.cache
def _checker(schema: str, read: tuple = ()):
    node = {"$ref": schema} if "#" in schema else load(schema)  # FILE#/POINTER: one part of a schema
    return _compile(node, read or None)


def _node(node: dict) -> dict:
    """A schema node with its `$ref` (a file of schemas/ and a JSON pointer) followed."""
    if "$ref" not in node:
        return node
    name, _, pointer = node["$ref"].partition("#")
    node = load(name)
    for part in pointer.strip("/").split("/"):
        node = node[part]
    return node


def _compile(node: dict, read: tuple | None = None):
    """A schema node -> check(value) -> the first problem or None; `read` (schema_problem's): an object node checks
    those of its properties only (required where the schema requires them), and no others."""
    node = _node(node)
    if "anyOf" in node:
        branches = [_compile(n, read) for n in node["anyOf"]]

        def any_of(value):
            problems = [b(value) for b in branches]
            return None if None in problems else problems[0]

        return any_of
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or ())
    types = tuple(t for k in kinds for t in _JSON_TYPES[k] if k != "boolean")
    boolean = "boolean" in kinds
    # A count below the schema's minimum (a shard of -1 bytes) or past int64 (no reader's column holds it): refused
    # at load, naming the field, rather than met later as a storage fault or an OverflowError.
    low = node.get("minimum", -(1 << 63)) if "integer" in kinds or "number" in kinds else None
    high = min(node.get("maximum", (1 << 63) - 1), (1 << 63) - 1) if low is not None else None
    required = tuple(node.get("required", ()))
    props = {k: _compile(sub) for k, sub in node.get("properties", {}).items()} if read is None else {}
    other = _compile(node["additionalProperties"]) if isinstance(node.get("additionalProperties"), dict) else None
    if read is not None and "properties" in node:  # a reader's part: the fields it reads, nothing else
        fields = dict(f if isinstance(f, tuple) else (f, None) for f in read)
        assert set(fields) <= set(node["properties"]), f"not in the schema: {set(fields) - set(node['properties'])}"
        props = {k: _compile(sub, fields[k]) for k, sub in node["properties"].items() if k in fields}
        required, other = tuple(k for k in required if k in fields), None
    items = _compile(node["items"], read) if "items" in node else None

    def check(value):  # -> None, or (the path to the fault, innermost first; what is wrong there)
        if kinds and not (boolean if isinstance(value, bool) else isinstance(value, types)):  # true is no integer
            return [], f"is {type(value).__name__}, not {' or '.join(kinds)}"
        if low is not None and not isinstance(value, bool) and isinstance(value, (int, float)):
            if value < low:
                return [], f"is {value}, below its minimum {low}"
            if value > high:
                return [], f"is {value}, past its maximum {high}"
        if isinstance(value, dict):
            missing = next((k for k in required if k not in value), None)
            if missing is not None:
                return [], f"has no {missing!r}"
            for k, v in value.items():
                sub = props.get(k, other)
                problem = sub(v) if sub is not None else None
                if problem:
                    problem[0].append(k)
                    return problem
        elif isinstance(value, list) and items is not None:
            for k, x in enumerate(value):
                problem = items(x)
                if problem:
                    problem[0].append(k)
                    return problem
        return None

    return check


def past_int64(value, where: str = "") -> str | None:
    """The first field of a parsed JSON value (its dotted path; "it" for the value itself) holding an integer outside
    int64, which no count or table column holds (JSON has no bound: a reject numbered 10^30); None where none is."""
    if isinstance(value, int) and not isinstance(value, bool):
        return where or "it" if not -(1 << 63) <= value < 1 << 63 else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = past_int64(v, f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None
