"""Round 5 of the hostile cases (issue 53.6): text from a dataset, a bucket or a server never reaches the terminal
raw. Sample text, ids, reject reasons and messages, input names and bucket keys carrying OSC 52 (a clipboard write),
OSC 0 (the window title), CSI (clear the screen), their C1 forms and bidi overrides go through `inspect`, `stats` and
refusals (vlmprep's and the trainer's one-line errors) escaped by one function, vlmprep_schemas.terminal."""

import json
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

from vlmprep_schemas.terminal import for_terminal

OSC52 = "\x1b]52;c;aGVsbG8=\x07"  # writes "hello" to the clipboard
OSC0 = "\x1b]0;PWNED\x1b\\"  # sets the window title (ST-terminated)
CSI = "\x1b[2J\x1b[H"  # clears the screen, cursor home
C1 = "\x9b31m\x9d0;t\x9c"  # CSI and OSC in their one-byte C1 forms
BIDI = "\u202egnp.exe"  # right-to-left override: reads as exe.png
HOSTILE = (OSC52, OSC0, CSI, C1, BIDI)
# What must never appear raw: ESC, BEL, the C1 controls used above, the override.
RAW = ("\x1b", "\x07", "\x9b", "\x9c", "\x9d", "\u202e")


def _clean(text: str) -> None:
    found = [c for c in RAW if c in text]
    assert not found, (found, text[:2000])


@pytest.mark.parametrize("seq", HOSTILE, ids=["osc52", "osc0", "csi", "c1", "bidi"])
def test_the_escape_spells_out_every_control_sequence(seq):
    one = for_terminal(f"a{seq}\nb\tc\r")
    _clean(one)
    assert "\n" not in one and "\t" in one and one.endswith("\\r") and "\\n" in one
    many = for_terminal(f"a{seq}\nb", lines=True)
    _clean(many)
    assert many.count("\n") == 1 and for_terminal(many, lines=True) == many and for_terminal(one) == one
    assert (
        for_terminal("plain text, ünïcödé, 日本語, emoji \U0001f600") == "plain text, ünïcödé, 日本語, emoji \U0001f600"
    )
    assert for_terminal("\udc80") == "\\udc80" and for_terminal("\x7f\x85\u2028") == "\\x7f\\x85\\u2028"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    """A dataset built from an input file whose name holds OSC 0, with records whose ids and text hold every
    sequence, and a record rejected with the sequences in its id and file name."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    d = tmp_path_factory.mktemp("terminal")
    src = d / f"in{OSC0}.jsonl"
    rows = [
        {
            "id": f"r{i}{seq}",
            "messages": [
                {"role": "user", "content": f"ask {seq} me"},
                {"role": "assistant", "content": f"ok{seq}\nyes"},
            ],
        }
        for i, seq in enumerate(HOSTILE)
    ]
    rows.append({"id": f"bad{OSC52}", "messages": [{"role": "user", "content": f"no answer {CSI}"}]})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build(
        BuildConfig(
            inputs=(str(src),), out=str(d / "ds"), processor="tiny:qwen2-vl", progress=False, max_reject_fraction=1.0
        )
    )
    return d / "ds"


def _run(*args: str):
    from vlmprep.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("extra", [[], ["--tokens"], ["--only", "rejected"]], ids=["text", "tokens", "rejects"])
def test_inspect_prints_no_control_sequence_from_the_dataset(hostile, extra):
    """Before: the samples' text, ids and file names reached the terminal raw (OSC 52 wrote the clipboard)."""
    res = _run("inspect", str(hostile), "--limit", "10", *extra)
    assert res.exit_code == 0, res.output
    _clean(res.output)
    if not extra:  # the sample text keeps its own newlines, its sequences spelled out
        assert "ok\\x1b]52;c;aGVsbG8=\\x07\nyes" in res.output and "\\u202egnp.exe" in res.output
    if extra == ["--only", "rejected"]:
        assert "bad\\x1b]52;c;aGVsbG8=\\x07" in res.output


def test_inspect_in_a_terminal_prints_no_control_sequence_from_the_dataset(hostile):
    """The rich view (a terminal): rich's own styling codes only, none of the dataset's."""
    import io

    from rich.console import Console

    from vlmprep.config import InspectConfig
    from vlmprep.tools.inspector import run_inspect

    for tokens in (False, True):
        buf = io.StringIO()
        run_inspect(InspectConfig(path=str(hostile), limit=10, tokens=tokens), Console(file=buf, force_terminal=True))
        out = buf.getvalue()
        assert "\x1b[" in out  # rich's colours: it did print to a terminal
        for seq in ("\x1b]", "\x1b[2J", "\x07", "\x9b", "\x9d", "\u202e"):
            assert seq not in out, (seq, out[:2000])


def test_stats_prints_no_control_sequence_from_the_dataset(hostile, tmp_path):
    """Input names and reject reasons from the manifest (a hostile one names them freely), each row one line."""
    ds = tmp_path / "ds"
    shutil.copytree(hostile, ds)
    m = json.loads((ds / "manifest.json").read_text())
    m["rejects"] = {f"made_up{OSC52}\nfake line": 1}
    (ds / "manifest.json").write_text(json.dumps(m))
    res = _run("stats", str(ds))
    assert res.exit_code == 0, res.output
    _clean(res.output)
    assert f"in{for_terminal(OSC0)}.jsonl" in res.output and not any(
        ln.startswith("fake line") for ln in res.output.splitlines()
    )


def test_a_refusal_quoting_the_dataset_is_one_escaped_line(hostile, tmp_path, capsys):
    """A manifest whose totals carry a key holding the sequences: vlmprep's refusal (verify, stats, inspect) and the
    trainer's name the key, escaped, in one line."""
    from trainer.train import main

    ds = tmp_path / "ds"
    shutil.copytree(hostile, ds)
    m = json.loads((ds / "manifest.json").read_text())
    m["totals"][f"key{OSC52}{CSI}\nnext"] = "not a count"
    (ds / "manifest.json").write_text(json.dumps(m))
    for command in ("verify", "stats", "inspect"):
        res = _run(command, str(ds))
        assert res.exit_code == 1, res.output
        _clean(res.output)
        errors = [ln for ln in res.output.splitlines() if ln.startswith(("error: ", "FAIL "))]  # verify: FAIL
        assert len(errors) == 1 and "key\\x1b]52" in errors[0] and "\\nnext" in errors[0], res.output
    args = ["--data", str(ds), "--out", str(tmp_path / "run"), "--tiny-random", "qwen2-vl", "--max-steps", "1"]
    assert main([*args, "--num-workers", "0", "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    _clean(err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trainer: error: ") and "key\\x1b]52" in lines[0], lines


def test_a_bucket_key_in_a_refusal_is_escaped(tmp_path, monkeypatch):
    """A bucket holding an object no build wrote, its key holding the sequences: the refusal names it escaped."""
    monkeypatch.setenv("VLMPREP_STAGE", str(tmp_path / "stages"))
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    url = f"memory://keys-{uuid.uuid4().hex[:8]}/ds"
    fsspec.filesystem("memory").pipe_file(f"{url}/note{OSC52}{BIDI}.txt", b"x")
    res = _run("build", "--in", str(src), "--out", url, "--processor", "tiny:qwen2-vl", "--no-progress")
    assert res.exit_code == 1, res.output
    _clean(res.output)
    assert "note\\x1b]52;c;aGVsbG8=\\x07\\u202egnp.exe.txt" in res.output, res.output
