"""The tokenizer as render uses it: a text -> its token ids and each token's [start, end) chars, or only its token
count, exactly as the tokenizer gives them. A run of N repeated placeholders (an image's <|image_pad|> x N, most of an
agent trace's tokens) is tokenized as one copy and repeated, never N times.
"""

from __future__ import annotations

import re
from typing import Iterator

import numpy as np


class TextEncoder:
    """A tokenizer with the shortcuts render needs, set up once per process. `specials`: its special tokens;
    `repeated`: the placeholders the processor repeats. Each is a special token, which the tokenizer splits out before
    it tokenizes the text around it, so a run of N is N copies of one id whatever surrounds it: encode() tokenizes
    each run as one copy and repeats it (where a probe shows this tokenizer splits them off; else runs go whole)."""

    def __init__(self, tokenizer, *, specials: set[str], repeated: set[str]):
        self.tokenizer = tok = tokenizer
        self._backend = _plain_backend(tok)
        self._decoder = _plain_decoder(tok)
        if getattr(tok, "split_special_tokens", False):
            repeated = set()
        self.run_tokens = sorted(repeated, key=len, reverse=True)
        self.run_re = re.compile("|".join(f"(?:{re.escape(t)}){{2,}}" for t in self.run_tokens)) if repeated else None
        probe = "".join(f"a{t * 3} b{t}{t}\n{t}" for t in self.run_tokens)
        if repeated and not all(
            np.array_equal(x, y) for x, y in zip(self.encode(probe), self._tokenize(probe, offsets=True))
        ):
            self.run_tokens, self.run_re = [], None  # this tokenizer does not split them off: tokenize runs whole
        self.boundary_re, self.post_specials = _segment_boundaries(tok, specials)

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The token ids of `text` and each token's [start, end) chars (N x 2), exactly as the tokenizer gives them,
        with its BOS unless the text starts with it. Each run of a repeated placeholder is tokenized as one copy, then
        repeated (see run_re)."""
        short, runs = shorten_runs(text, self.run_re, self.run_tokens)
        ids, spans = self._tokenize(short, offsets=True)
        if not runs:
            return ids, spans
        first = _run_tokens(runs, spans)
        if first is None:
            return self._tokenize(text, offsets=True)  # no shortcut: tokenize it all
        reps = np.ones(len(spans), dtype=np.int64)
        reps[first] = [k for _, k, _ in runs]
        return np.repeat(ids, reps), _repeat_spans(spans, runs, first, reps)

    def count(self, text: str, pieces: dict[str, int] | None = None) -> int:
        """len(encode(text)[0]), without offsets. With `pieces` (a dict kept over the candidate samples of one record,
        where most text recurs): the text between the tokenizer's split-out added tokens is tokenized once per
        distinct piece, its count kept there (see _segment_boundaries)."""
        short, runs = shorten_runs(text, self.run_re, self.run_tokens)
        repeats = sum(k - 1 for _, k, _ in runs)
        if pieces is None or self.boundary_re is None:
            return len(self._tokenize(short, offsets=False)[0]) + repeats
        return self._count_pieces(short, pieces) + repeats

    def _count_pieces(self, text: str, pieces: dict[str, int]) -> int:
        split = self.boundary_re.split(text)  # one capturing group: the split-out tokens at odd positions
        new = [p for p in dict.fromkeys(split[::2]) if p and p not in pieces]
        if new:
            backend = self.tokenizer.backend_tokenizer
            for p, enc in zip(new, backend.encode_batch(new, add_special_tokens=False)):
                pieces[p] = len(enc.ids)
        bos = self.tokenizer.bos_token
        added = 0 if bos and text.startswith(bos) else self.post_specials
        return added + len(split) // 2 + sum(pieces[p] for p in split[::2] if p)

    def decode(self, ids: np.ndarray) -> str:
        """The tokenizer's decode of `ids`, special tokens kept, no clean-up of spaces (the mask proof's)."""
        if self._decoder is not None:
            return self._decoder.decode(ids.tolist(), skip_special_tokens=False)
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _tokenize(self, text: str, *, offsets: bool) -> tuple[np.ndarray, np.ndarray | None]:
        bos = self.tokenizer.bos_token
        add = not (bos and text.startswith(bos))
        backend = self._backend
        if backend is not None and backend.truncation is None and backend.padding is None:
            if backend.encode_special_tokens == self.tokenizer.split_special_tokens:
                enc = backend.encode_batch([text], add_special_tokens=add)[0]
                return (
                    np.asarray(enc.ids, dtype=np.int64),
                    np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2) if offsets else None,
                )
        enc = self.tokenizer(text, add_special_tokens=add, return_offsets_mapping=offsets)
        return (
            np.asarray(enc["input_ids"], dtype=np.int64),
            np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) if offsets else None,
        )


def _plain_backend(tok):
    """The tokenizers backend that `tok(text, ...)` runs where it adds nothing to it (the plain TokenizersBackend
    path: its encode_batch of the one text, no truncation, padding or mode switch), so _tokenize calls it directly
    (a fifth of a short record's tokenize is the wrapper); None for any tokenizer that overrides that path."""
    return _backend_if(
        tok,
        lambda cls, base, backend: (
            cls.__call__ is base.__call__
            and cls._get_padding_truncation_strategies is base._get_padding_truncation_strategies
            and cls._encode_plus is backend._encode_plus
            and cls._convert_encoding is backend._convert_encoding
            and cls.set_truncation_and_padding is backend.set_truncation_and_padding
            and not hasattr(tok, "_switch_to_input_mode")
        ),
    )


def _plain_decoder(tok):
    """The tokenizers backend whose decode `tok.decode(ids, skip_special_tokens=False,
    clean_up_tokenization_spaces=False)` returns as it is (the plain TokenizersBackend path), so decode calls it
    directly (the wrapper costs twice the backend's decode of a short span); None for any tokenizer that overrides
    that path."""
    return _backend_if(tok, lambda cls, base, backend: cls.decode is base.decode and cls._decode is backend._decode)


def _backend_if(tok, plain) -> object | None:
    """tok's tokenizers backend where tok is a TokenizersBackend and plain(its class, PreTrainedTokenizerBase,
    TokenizersBackend) holds; None otherwise."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: always through the tokenizer itself
        return None
    if isinstance(tok, TokenizersBackend) and plain(type(tok), PreTrainedTokenizerBase, TokenizersBackend):
        return tok.backend_tokenizer
    return None


def shorten_runs(text: str, run_re: re.Pattern | None, tokens: list[str]) -> tuple[str, list[tuple[int, int, int]]]:
    """`text` with each run of a repeated placeholder cut to one copy, and each run's (start in the short text, copies,
    chars per copy)."""
    if run_re is None:
        return text, []
    pieces, runs, cut, length = [], [], 0, 0
    for m in _runs(text, run_re, tokens):
        unit = next(len(t) for t in tokens if text.startswith(t, m.start(), m.end()))
        pieces.append(text[cut : m.start() + unit])
        length += len(pieces[-1])
        runs.append((length - unit, (m.end() - m.start()) // unit, unit))
        cut = m.end()
    return ("".join(pieces) + text[cut:], runs) if runs else (text, [])


def _runs(text: str, run_re: re.Pattern, tokens: list[str]) -> Iterator[re.Match]:
    """run_re.finditer(text)'s matches, for run_re as TextEncoder builds it (two or more copies of each of `tokens`, in
    their order): each found by str.find of two copies of each token (the regex's scan tries the alternation at every
    char: 40 times the finds on a short record), then matched where the first one starts."""
    doubles = [t + t for t in tokens]
    at = [text.find(d) for d in doubles]  # each token's first run at or after the last match's end (-1: none)
    cut = 0
    while True:
        for k, d in enumerate(doubles):
            if 0 <= at[k] < cut:
                at[k] = text.find(d, cut)
        start = min((a for a in at if a >= 0), default=-1)
        if start < 0:
            return
        m = run_re.match(text, start)  # the leftmost run starts here; the alternation picks as finditer's does
        yield m
        cut = m.end()


def _run_tokens(runs: list[tuple[int, int, int]], spans: np.ndarray) -> list[int] | None:
    """The short text's token that stands for each run (its copies are repeated); None where a run's copy is not one
    token of its own (then the shortcut does not apply)."""
    first = np.searchsorted(spans[:, 0], [r[0] for r in runs]).tolist()
    for (at, _, unit), i in zip(runs, first):  # a few runs a sample: scalar checks beat array set-up
        if i >= len(spans) or spans[i, 0] != at or spans[i, 1] != at + unit:
            return None
    return first


def _repeat_spans(
    spans: np.ndarray, runs: list[tuple[int, int, int]], first: list[int], reps: np.ndarray
) -> np.ndarray:
    """The short text's token spans -> the text's: each run's copies side by side, every later span moved by the
    chars the runs add."""
    at = np.array([r[0] for r in runs], dtype=np.int64)
    added = np.concatenate([[0], np.cumsum([(k - 1) * u for _, k, u in runs])])
    moved = spans + added[np.searchsorted(at, spans, side="left")]  # runs that start before each char
    out = np.repeat(moved, reps, axis=0)
    extra = 0  # copies the runs before this one added ahead of its token
    for (_start, k, unit), i in zip(runs, first):
        p = i + extra
        out[p : p + k, 0] = moved[i, 0] + unit * np.arange(k)
        out[p : p + k, 1] = out[p : p + k, 0] + unit
        extra += k - 1
    return out


def _segment_boundaries(tok, specials: set[str]) -> tuple[re.Pattern | None, int]:
    """The added tokens the tokenizer splits out of the raw text before it normalizes, pre-tokenizes and encodes the
    text between them (no lstrip / rstrip / single_word, not normalized), as one capturing alternation, longest first
    (the tokenizer's leftmost-longest match): a text's token count is then the sum over the text between them, plus
    one per token, plus what the post-processor adds. None where that does not hold for this tokenizer (special
    tokens not split, or a pre-tokenizer that treats a text's first piece apart, such as a prefix space), checked on
    a probe against the whole text's encode. Also returns how many tokens the post-processor adds (a BOS)."""
    post = len(tok("", add_special_tokens=True)["input_ids"]) - len(tok("", add_special_tokens=False)["input_ids"])
    if getattr(tok, "split_special_tokens", False):
        return None, post
    clean = {
        t.content
        for t in tok.added_tokens_decoder.values()
        if not (t.normalized or t.lstrip or t.rstrip or t.single_word)
    }
    pattern = alternation(clean)
    if pattern is None:
        return None, post
    boundary = re.compile(f"({pattern.pattern})")
    probe = "".join(f"{t}\u0301 a{t}  b\n{t}{t}c{t} \n" for t in sorted(clean & specials)[:8]) + " x\u00e9\n"
    whole = len(tok(probe, add_special_tokens=True)["input_ids"])
    split = boundary.split(probe)
    parts = sum(
        len(e.ids) for e in tok.backend_tokenizer.encode_batch([p for p in split[::2] if p], add_special_tokens=False)
    )
    return (boundary if parts + len(split) // 2 + post == whole else None), post


def alternation(strings) -> re.Pattern | None:
    """One pattern matching any of `strings`, longest first (None for none)."""
    strings = sorted((s for s in strings if s), key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in strings)) if strings else None
