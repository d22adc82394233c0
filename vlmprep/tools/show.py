"""Terminal printers of a SampleView: plain text with [T]...[/T] around trained runs (piped output), rich colours
in a terminal, and the per-token table (--tokens). Everything from the dataset is escaped for the terminal
(vlmprep_schemas.terminal): a sample's text keeps its newlines, a header, fact or table line stays one line.
"""

from __future__ import annotations

import numpy as np

from vlmprep.tools.view import SampleView, fact_lines, header_line, message_line, run_marker
from vlmprep_schemas.terminal import for_terminal


def _text(text: str) -> str:
    """A sample's own text as the terminal shows it: its newlines kept, every control sequence spelled out."""
    return for_terminal(text, lines=True)


def _heads(v: SampleView) -> tuple[str, list[str]]:
    """The sample's header and fact lines, each one line with no control sequence (ids and file names come from the
    dataset)."""
    return for_terminal(header_line(v)), [for_terminal(line) for line in fact_lines(v)]


def format_plain(v: SampleView) -> str:
    """Plain text: the conversation with [T]...[/T] around each trained run, then the facts."""
    head, facts = _heads(v)
    out = [head]
    for m in v.messages:
        body = []
        for trained, segs in m.runs:
            text = _text("".join(seg.text for seg in segs))
            body.append(f"[T]{text}[/T]" if trained else text)
        out.append(for_terminal(message_line(m)))
        out.append("".join(body).removesuffix("\n"))
    out += facts
    return "\n".join(out) + "\n"


_STYLE = {"text": "dim", "special": "bold magenta", "image": "bold cyan", "video": "bold cyan"}
_TRAINED = "black on green"


def format_rich(v: SampleView):
    """The same view as rich Text: trained tokens on green, masked text dim, special tokens and images bold."""
    from rich.text import Text

    head, facts = _heads(v)
    t = Text()
    t.append(head + "\n", style="bold")
    for m in v.messages:
        t.append(for_terminal(message_line(m)) + "\n", style="bold blue")
        for seg in m.segments:
            style = _STYLE[seg.kind]
            if seg.trained:
                style = _TRAINED if seg.kind == "text" else f"{style} {_TRAINED}"
            t.append(_text(seg.text), style=style)
        if m.segments and not m.segments[-1].text.endswith("\n"):
            t.append("\n")
    for line in facts:
        t.append(line + "\n", style="yellow" if line.startswith(("WARNING", "note")) else "")
    return t


def token_rows(v: SampleView) -> list[tuple[str, str, str, str, str]]:
    """(index, id, mask, type, piece) per token; each image's whole unit (type 1) or video placeholder run is one
    row, as in the conversation view, and the text inside a video block (Qwen3-VL's timestamps) is listed token by
    token."""
    s = v.sample
    text_idx = np.flatnonzero(np.asarray(s.mm_token_type_ids) == 0)
    pieces = dict(zip(text_idx.tolist(), v.tokenizer_view.pieces(np.asarray(s.input_ids)[text_idx])))
    rows = []
    for m in v.messages:
        for seg in m.segments:
            if seg.kind == "image":
                rows.append(
                    (
                        f"{seg.start}-{seg.end - 1}",
                        str(int(s.input_ids[seg.start])),
                        str(int(seg.trained)),
                        "1",
                        seg.text,
                    )
                )  # the image's whole unit, wrappers included
                continue
            if seg.kind == "video":
                rows += _video_rows(v, seg, pieces)
                continue
            for i in range(seg.start, seg.end):
                rows.append(
                    (
                        str(i),
                        str(int(s.input_ids[i])),
                        str(int(s.loss_mask[i])),
                        str(int(s.mm_token_type_ids[i])),
                        repr(pieces[i]),
                    )
                )
    return rows


def _video_rows(v: SampleView, seg, pieces: dict[int, str]) -> list[tuple[str, str, str, str, str]]:
    s = v.sample
    rows = []
    for j, (a, b) in enumerate(seg.runs):
        if j:  # the text between two runs
            prev = seg.runs[j - 1][1]
            rows += [
                (
                    str(i),
                    str(int(s.input_ids[i])),
                    str(int(s.loss_mask[i])),
                    str(int(s.mm_token_type_ids[i])),
                    repr(pieces[i]),
                )
                for i in range(prev, a)
            ]
        text = seg.text if j == 0 else run_marker(seg.video, j, len(seg.runs), b - a)  # runs > 1: a matched video
        rows.append((f"{a}-{b - 1}", str(int(s.input_ids[a])), str(int(s.loss_mask[a])), "2", text))
    return rows


_TOKEN_COLUMNS = ("index", "id", "mask", "type", "piece")


def _token_table(rows: list[tuple[str, ...]]) -> list[str]:
    w = [max([len(c)] + [len(r[j]) for r in rows]) for j, c in enumerate(_TOKEN_COLUMNS[:4])]
    head = "  ".join(c.rjust(w[j]) for j, c in enumerate(_TOKEN_COLUMNS[:4])) + "  piece"
    return [head] + ["  ".join(r[j].rjust(w[j]) for j in range(4)) + "  " + for_terminal(r[4]) for r in rows]


def format_tokens_plain(v: SampleView) -> str:
    """One sample's token table as plain text (index, id, mask, type, piece), with its header and facts."""
    head, facts = _heads(v)
    return "\n".join([head, *_token_table(token_rows(v)), *facts]) + "\n"


def format_tokens_rich(v: SampleView):
    """The same token table as styled rich Text for a terminal."""
    # Styled lines rather than a rich Table: a Table lays out 30k rows in seconds, lines in milliseconds.
    from rich.text import Text

    rows = token_rows(v)
    lines = _token_table(rows)
    head, facts = _heads(v)
    t = Text()
    t.append(head + "\n", style="bold")
    t.append(lines[0] + "\n", style="bold")
    for r, line in zip(rows, lines[1:]):
        t.append(line + "\n", style=_TRAINED if r[2] == "1" else ("bold cyan" if r[3] != "0" else "dim"))
    t.append("\n".join(facts) + "\n")
    return t
