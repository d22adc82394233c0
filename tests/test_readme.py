"""The README and docs/ are a contract: every fenced bash/python example carries a `<!-- readme-test: ... -->`
marker, and the marked ones run as written here (small inputs in place of the large ones the docs name). The pages
are README.md, then docs/*.md in the order of the README's list of pages.

Markers (an HTML comment on the line before the fence, invisible on GitHub):
    run [setup=NAME] [slow] [sub="OLD=>NEW"]...     a bash block: its commands run with `bash -e` in a copy of a
                                                    prepared workspace and must exit 0
    output [setup=NAME] [slow] [sub=...]...         a transcript: each `$ command` runs and its stdout must equal the
                                                    lines shown under it (`# excerpt` on the command: `...` lines
                                                    stand for any run of lines)
    python [setup=NAME] [slow]                      a python block: run as a script in the workspace
    skip REASON                                     not runnable here (a GPU, a checkpoint path, a cluster): says why
Substitutions are literal and visible in the marker, e.g. `sub="--workers 8=>--workers 2"` on a 2-core box.
`defines=NAME` on a run block makes its commands (after the block's own setup) the setup NAME of later blocks, so
a page's inputs are made by commands the reader sees. Alone, each block runs in a copy of its setup (the default
tier); `test_the_docs_walk_in_document_order_in_one_directory` (slow) runs them all in ONE empty directory in
document order, as a newcomer would, and fails on a refusal or a command that silently did nothing.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vlmprep.rejects import REASONS, reasons_table
from vlmprep.types import RecordError

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC_LINK = re.compile(r"\]\((docs/[a-z0-9\-]+\.md)\)")


DOC_LIST = re.compile(r"^- \[[^\]]+\]\((docs/[a-z0-9\-]+\.md)\)", re.M)


def doc_pages() -> list[Path]:
    """README.md, then each docs/ page in the order of the README's list of pages (the order a user reads them; a page
    only linked inline comes after)."""
    text = README.read_text()
    linked = list(dict.fromkeys(DOC_LIST.findall(text) + DOC_LINK.findall(text)))
    return [README] + [REPO / rel for rel in linked]


MARKER = re.compile(r"^<!-- readme-test: (.*?) -->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
KINDS = ("run", "output", "python", "skip")


@dataclass
class Example:
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    doc: str = "README.md"  # the page, relative to the repo
    kind: str | None = None
    setup: str = "none"
    slow: bool = False
    defines: str = ""  # the setup this block's commands make for later blocks
    subs: list[tuple[str, str]] = field(default_factory=list)
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.doc} line {self.line}"

    @property
    def test_id(self) -> str:
        return f"{self.doc}:L{self.line}-{self.kind}"


def parse_readme(text: str, doc: str = "README.md") -> list[Example]:
    lines = text.splitlines()
    out: list[Example] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        ex = Example(line=i + 1, doc=doc, lang=m.group(1), body="\n".join(lines[i + 1 : end]) + "\n")
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            _apply_marker(ex, marker.group(1))
        out.append(ex)
        i = end + 1
    return out


def _apply_marker(ex: Example, spec: str) -> None:
    if spec.split()[0] == "skip":  # free text: the reason, read by people
        ex.kind, ex.reason = "skip", spec[len("skip") :].strip()
        return
    words = shlex.split(spec)
    ex.kind = words[0]
    for w in words[1:]:
        if w == "slow":
            ex.slow = True
        elif w.startswith("setup="):
            ex.setup = w[len("setup=") :]
        elif w.startswith("defines="):
            ex.defines = w[len("defines=") :]
        elif w.startswith("sub="):
            old, sep, new = w[len("sub=") :].partition("=>")
            assert sep, f"{ex.where}: sub needs OLD=>NEW, got {w!r}"
            ex.subs.append((old, new))
        else:
            raise AssertionError(f"{ex.where}: unknown marker word {w!r}")


def substitute(ex: Example, text: str) -> str:
    for old, new in ex.subs:
        assert old in text, f"{ex.where}: substitution {old!r} matches nothing (stale marker)"
        text = text.replace(old, new)
    return text


EXAMPLES = [e for page in doc_pages() for e in parse_readme(page.read_text(), str(page.relative_to(REPO)))]
RUNNABLE = [e for e in EXAMPLES if e.kind in ("run", "output", "python")]


def test_every_example_is_marked_and_markers_are_valid():
    unmarked = [e.where for e in EXAMPLES if e.lang in ("bash", "python", "sh") and e.kind is None]
    assert not unmarked, f"code blocks without a readme-test marker: {unmarked}"
    for e in EXAMPLES:
        if e.kind is None:
            continue
        assert e.kind in KINDS, f"{e.where}: unknown kind {e.kind!r}"
        assert e.kind != "skip" or e.reason, f"{e.where}: skip needs a reason"
        assert e.kind == "skip" or e.setup in SETUPS, f"{e.where}: unknown setup {e.setup!r}"
        assert e.kind != "output" or e.body.startswith("$ "), f"{e.where}: a transcript starts with '$ '"


def test_the_parser_reads_markers_substitutions_and_transcripts():
    text = (
        '<!-- readme-test: run setup=traces slow sub="--workers 8=>--workers 2" -->\n```bash\n'
        "vlmprep build --workers 8\n```\n\n```python\nprint(1)\n```\n"
    )
    run, py = parse_readme(text)
    assert (run.kind, run.setup, run.slow, run.subs) == ("run", "traces", True, [("--workers 8", "--workers 2")])
    assert substitute(run, run.body) == "vlmprep build --workers 2\n"
    assert py.kind is None and py.lang == "python"
    with pytest.raises(AssertionError, match="matches nothing"):
        substitute(run, "no such option")
    cmds = split_transcript("$ a \\\n    b   # excerpt\nx\n...\n$ c\ny\n")
    assert cmds == [("a \\\n    b   # excerpt", ["x", "..."]), ("c", ["y"])]
    assert matches(["x", "...", "z"], ["x", "1", "2", "z"], excerpt=True)
    assert not matches(["x", "z"], ["x", "1", "z"], excerpt=False)
    assert not matches(["x", "...", "z"], ["x", "1"], excerpt=True)


# --- workspaces -------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)  # scripts/ (the demo generator) is not installed
    env.pop("VLMPREP_DEBUG", None)
    env["COLUMNS"] = "200"
    return env


def _sh(cmd: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", cmd],
        cwd=cwd,
        env=_env(),
        text=True,
        capture_output=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# Each setup is a list of shell lines run once per session in an empty dir; tests get a copy of it. Every other setup
# is made by the docs' own blocks (`defines=NAME`), so what a block needs is what a reader walking the docs has.
SETUPS: dict[str, list[str]] = {"none": []}


@pytest.fixture(scope="session")
def workspaces(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            d = tmp_path_factory.mktemp(f"readme-{name}")
            for line in SETUPS[name]:
                r = _sh(line, d)
                assert r.returncode == 0, f"setup {name}: {line}\n{r.stdout}\n{r.stderr}"
            made[name] = d
        return made[name]

    return get


@pytest.fixture
def workspace(workspaces, tmp_path, request):
    ex: Example = request.param
    src = workspaces(ex.setup)
    dst = tmp_path / "ws"
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --- transcripts ------------------------------------------------------------------------------------------------


def split_transcript(body: str) -> list[tuple[str, list[str]]]:
    """`$ cmd` (with backslash continuations) followed by its expected output lines."""
    out: list[tuple[str, list[str]]] = []
    lines = body.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        assert lines[i].startswith("$ "), f"transcript line {lines[i]!r} is not a command"
        cmd = [lines[i][2:]]
        while cmd[-1].split("#")[0].rstrip().endswith("\\"):
            i += 1
            cmd.append(lines[i])
        i += 1
        expected = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i])
            i += 1
        while expected and not expected[-1].strip():
            expected.pop()
        out.append(("\n".join(cmd), expected))
    return out


def matches(expected: list[str], got: list[str], *, excerpt: bool) -> bool:
    if not excerpt:
        return expected == got

    @functools.lru_cache(maxsize=None)
    def fit(i: int, j: int) -> bool:  # expected[i:] against got[j:]; "..." takes any run of lines, none included
        if i == len(expected):
            return j == len(got)
        if expected[i] == "...":
            return any(fit(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and expected[i] == got[j] and fit(i + 1, j + 1)

    return fit(0, 0)


def _commands(ex: Example) -> str:
    """A run block's body, or a transcript's commands (their output is checked where the block itself runs)."""
    if ex.kind == "run":
        return substitute(ex, ex.body)
    return "\n".join(f"{substitute(ex, cmd)} >/dev/null" for cmd, _ in split_transcript(ex.body))


for _ex in RUNNABLE:  # setups made by the docs' own blocks, in document order
    if _ex.defines:
        assert _ex.kind in ("run", "output") and _ex.defines not in SETUPS, (
            f"{_ex.where}: defines={_ex.defines} taken, or not a run or output block"
        )
        SETUPS[_ex.defines] = [*SETUPS[_ex.setup], _commands(_ex)]


def _params():
    return [pytest.param(e, id=e.test_id, marks=[pytest.mark.slow] if e.slow else []) for e in RUNNABLE]


def run_example(ex: Example, cwd: Path) -> list[subprocess.CompletedProcess]:
    """Run one block in `cwd` as written (with its marker's substitutions) and check it: exit 0, or for a transcript
    the shown output. Returns the processes, for the walk's no-op check."""
    if ex.kind == "run":
        r = _sh(substitute(ex, ex.body), cwd)
        assert r.returncode == 0, f"{ex.where} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return [r]
    if ex.kind == "python":
        script = cwd / "example.py"
        script.write_text(substitute(ex, ex.body))
        r = subprocess.run(
            [sys.executable, str(script)], cwd=cwd, env=_env(), text=True, capture_output=True, timeout=900
        )
        script.unlink()
        assert r.returncode == 0, f"{ex.where} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return [r]
    done = []
    for cmd, expected in split_transcript(ex.body):
        r = _sh(substitute(ex, cmd), cwd)
        got = r.stdout.rstrip("\n").split("\n") if r.stdout.strip() else []
        got = [line.rstrip() for line in got]
        excerpt = "# excerpt" in cmd
        assert matches([line.rstrip() for line in expected], got, excerpt=excerpt), (
            f"{ex.where}: `{cmd}` printed (exit {r.returncode}):\n"
            + "\n".join(got)
            + f"\n--- stderr ---\n{r.stderr[-2000:]}"
        )
        done.append(r)
    return done


@pytest.mark.parametrize("workspace", _params(), indirect=True)
def test_readme_example_runs_as_written(workspace, request):
    run_example(request.node.callspec.params["workspace"], workspace)


# What the tools print when a command finds its work done already (a build found complete, a run resumed): in the
# walk no block may meet another block's output that way unless it shows it, or it did nothing the reader sees.
NO_OP = re.compile(r"resumed from|already complete|nothing (left )?to train|found complete|nothing to do")


@pytest.mark.slow  # every block of README.md and docs/, trainer runs included: ~15 min on 2 cores
def test_the_docs_walk_in_document_order_in_one_directory(tmp_path):
    """A newcomer's walk: README.md, then each docs page in the README's link order, every runnable block in ONE
    directory that starts empty (the quick start makes the inputs). No block is refused (each exits 0 or prints
    its transcript) and none silently does nothing: a build over another block's dataset, or a training command
    that resumes another block's finished run, fails here (the regression cases of three breaks a user met)."""
    for ex in RUNNABLE:
        for r in run_example(ex, tmp_path):
            said = NO_OP.search(r.stdout + r.stderr)
            assert not said or said.group(0) in ex.body, (
                f"{ex.where}: a silent no-op in the walk ({said.group(0)!r}):\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
            )


def test_the_walk_runs_every_page_and_refuses_a_stale_define():
    """The walk covers README.md and every linked page, and a `defines=` name is made once, by a run block."""
    walked = {e.doc for e in RUNNABLE}
    assert "README.md" in walked and {"docs/build.md", "docs/trainer.md"} <= walked
    text = "<!-- readme-test: run defines=x -->\n```bash\ntrue\n```\n"
    (ex,) = parse_readme(text)
    assert ex.defines == "x" and ex.kind == "run"


# --- the Rejects table ------------------------------------------------------------------------------------------

# Every way vlmprep/ names a reject reason: RecordError("x", ...), reject_entry(raw, "x", ...), "reason": "x",
# `reason = "x" if ... else "y"` / `reason, message = "x", ...` and rejects["x"] += 1.
REASON_IN_CODE = [
    re.compile(p)
    for p in (
        r'RecordError\(\s*"([a-z_0-9]+)"',
        r'reject_entry\([^,()]+,\s*"([a-z_0-9]+)"',
        r'"reason":\s*"([a-z_0-9]+)"',
        r'\breason(?:, message)?\s*=\s*"([a-z_0-9]+)"',
        r'\belse\s+"([a-z_0-9]+)"\s*$',
        r'\brejects\["([a-z_0-9]+)"\]',
    )
]


def _code_reasons() -> set[str]:
    found: set[str] = set()
    for path in (REPO / "vlmprep").rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.search(r"\breason\b|RecordError|reject", line):
                found.update(m.group(1) for pattern in REASON_IN_CODE for m in pattern.finditer(line))
    return found


def test_every_reject_reason_in_the_code_is_in_the_registry():
    """RecordError refuses an unknown reason when raised; this scan also covers the reasons written without it
    (reject_entry, "reason": ..., rejects[...]) and the ones only built at run time."""
    reasons = _code_reasons()
    assert {"invalid_json", "internal_error", "duplicate_id", "corrupt_zstd_stream"} <= reasons  # each spelling found
    missing = sorted(reasons - set(REASONS))
    assert not missing, f"reject reasons named in vlmprep/ but missing from vlmprep/rejects.py REASONS: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    pages = {p.name for p in doc_pages()[1:]}
    on_disk = {p.name for p in (REPO / "docs").glob("*.md")}
    assert on_disk == pages, f"docs/ pages the README does not link: {sorted(on_disk - pages)}"


def test_the_readme_rejects_table_is_the_registry():
    text = (REPO / "docs" / "rejects.md").read_text()
    marker = "<!-- reasons-table: generated from vlmprep/rejects.py REASONS (tests/test_readme.py compares) -->\n"
    start = text.index(marker) + len(marker)
    shown = text[start : text.index("\n\n", start) + 1]
    assert shown == reasons_table(), "docs/rejects.md's table differs from vlmprep/rejects.py: paste reasons_table()"


def test_record_error_refuses_an_unknown_reason():
    assert RecordError("invalid_json", "x").reason == "invalid_json"
    with pytest.raises(ValueError, match="unknown reject reason 'no_such_reason'"):
        RecordError("no_such_reason", "x")
