"""docs/development.md's map of the packages matches the tree: every module and folder of vlmprep/ and trainer/ is
named in it, and every file or folder it names exists (a move or a rename needs the map updated, nothing here)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vlmprep", "trainer")  # each of their modules and folders must be on the map
SPLIT = re.compile(r"\s{2,}")  # the gap between a row's names and its description
PY = re.compile(r"[\w./]*\w\.py\b")


def map_rows() -> list[str]:
    """The lines of the fenced block that opens with `vlmprep/` (the layout, in flow order)."""
    text = (REPO / "docs" / "development.md").read_text()
    block = re.search(r"^```\n(vlmprep/.*?)^```", text, re.M | re.S)
    assert block, "docs/development.md has no ``` block that starts with the vlmprep/ row"
    return block.group(1).splitlines()


def named_paths(rows: list[str]) -> set[str]:
    """Repo-relative paths a map names. A row at column 0 names a top folder (or a file); an indented row names files
    or a folder inside it; a .py name in a description lives in its row's folder (with a `/`, it is repo-relative)."""
    named, top, here = set(), "", ""
    for row in rows:
        indent = len(row) - len(row.lstrip())
        names, desc = (SPLIT.split(row.strip(), maxsplit=1) + [""])[:2] if indent <= 2 else ("", row)
        if indent == 0:
            top = names if names.endswith("/") else ""
            here = top or names.rpartition("/")[0] + "/"
            named.add(names)
        elif names:
            for name in re.split(r",\s*|\s*->\s*", names):
                named.add(top + name)
            here = top + names if names.endswith("/") else top
        for name in PY.findall(desc):
            named.add(name if "/" in name else here + name)
    return {n.rstrip("/") for n in named if n}


def tree_paths() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*"):
            rel = path.relative_to(REPO)
            if "__pycache__" in rel.parts or path.name == "__init__.py":
                continue
            if path.is_dir() or path.suffix == ".py":
                found.add(rel.as_posix())
    return found


def test_the_parser_reads_each_kind_of_row():
    rows = [
        "pkg/                 what it is",
        "  a.py, b.py -> c.py  stages",
        "  sub/               x.py: y.py (z.py) -> other/w.py",
        "                     v.py on a continuation line",
        "tool/t.py            a file at the top",
    ]
    assert named_paths(rows) == {
        "pkg",
        "pkg/a.py",
        "pkg/b.py",
        "pkg/c.py",
        "pkg/sub",
        "pkg/sub/x.py",
        "pkg/sub/y.py",
        "pkg/sub/z.py",
        "other/w.py",
        "pkg/sub/v.py",
        "tool/t.py",
    }


def test_the_development_map_names_every_module_and_nothing_else():
    named = named_paths(map_rows())
    missing = sorted(tree_paths() - named)
    assert not missing, f"modules or folders not on the map in docs/development.md: {missing}"
    gone = sorted(n for n in named if not (REPO / n).exists())
    assert not gone, f"docs/development.md's map names paths that do not exist: {gone}"
