"""What a terminal is shown of text from a dataset, a bucket or a server (sample text, ids, reject reasons and
messages, input names, object keys): the one escape vlmprep and the trainer apply where they print it. A terminal
acts on control sequences (OSC 52 writes the clipboard, OSC 0 the window title, CSI clears or moves the screen, C1
controls are their one-byte forms, bidi overrides reorder what is read): each is spelled out, never sent.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL and the C1 controls, the bidi embeddings, overrides and isolates and the
# implicit marks, the Unicode line and paragraph separators (a new line to some terminals), lone surrogates (which
# no terminal can encode), and the BOM / zero-width no-break space.
_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff\ufeff"
_LINE = re.compile(f"[{_UNSAFE}\n]")  # one line: its newlines escaped too
_LINES = re.compile(f"[{_UNSAFE}]")


def _spelled(m: re.Match) -> str:
    c = ord(m.group())
    return {0x0A: "\\n", 0x0D: "\\r"}.get(c) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")


def for_terminal(text, *, lines: bool = False) -> str:
    """`text` (any value: str() of it) as a terminal may be shown it: each control character (C0 with ESC, DEL and C1 as
    `\\xNN`, CR as `\\r`), bidi control, line separator and lone surrogate (`\\uNNNN`) spelled out,
    so none acts. `lines`: text that is printed as several lines (a sample's conversation, a multi-line report)
    keeps its newlines; else a newline is `\\n` too, and an error or progress line stays one line. Printable text,
    tabs and every other character are unchanged; escaping what it returned changes nothing more."""
    text = text if isinstance(text, str) else str(text)
    return (_LINES if lines else _LINE).sub(_spelled, text)
