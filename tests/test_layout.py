"""docs/development.md's map of the packages matches the tree: every module and folder of vlmprep/ and trainer/ is
named in it, and every file or folder it names exists (a move or a rename needs the map updated, nothing here); and
no module or function of vlmprep/, trainer/ or schemas/ outgrows the size limits."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vlmprep", "trainer")  # each of their modules and folders must be on the map
SPLIT = re.compile(r"\s{2,}")  # the gap between a row's names and its description
PY = re.compile(r"[\w./]*\w\.py\b")
SIZED = ("vlmprep", "trainer", "schemas")  # the packages held to the size limits
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # the def through its last line, docstring included


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


def oversized(path: Path) -> list[str]:
    """The module at `path` where it is over MAX_MODULE_LINES lines, and each function or method in it over
    MAX_FUNCTION_LINES, as `path: what (N lines)`."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    lines = text.count("\n")
    out = [f"{name}: module ({lines} lines)"] if lines > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            span = node.end_lineno - node.lineno + 1
            if span > MAX_FUNCTION_LINES:
                out.append(f"{name}:{node.lineno} {node.name} ({span} lines)")
    return out


def test_the_size_check_names_a_long_function_and_a_long_module(tmp_path):
    body = "".join(f"        x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "big.py"
    path.write_text("def short():\n    return 1\n\n\nclass C:\n    def long(self):\n" + body)
    assert oversized(path) == ["big.py:6 long (81 lines)"]
    path.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(path) == [f"big.py: module ({MAX_MODULE_LINES + 1} lines)"]
    path.write_text("x = 1\n" * MAX_MODULE_LINES)
    assert oversized(path) == []


def test_no_module_or_function_is_over_the_size_limits():
    found = [o for package in SIZED for path in sorted((REPO / package).rglob("*.py")) for o in oversized(path)]
    assert not found, (
        f"over the limits ({MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function): split by job "
        "(a coherent part into a module of its own, a stage of a function into a named helper): " + "; ".join(found)
    )


MAX_ROOT_MODULES = 12  # vlmprep's root: the shared types, config and registries; the stages live in packages


def test_vlmprep_root_shows_the_flow_and_each_package_has_a_face_and_a_readme():
    root = REPO / "vlmprep"
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, (
        f"{len(modules)} modules at vlmprep's root (at most {MAX_ROOT_MODULES}): {modules}"
    )
    for package in ("ingest", "pixels", "render"):
        face = root / package / "__init__.py"
        tree = ast.parse(face.read_text())
        exported = next(
            (n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"),
            None,
        )
        assert ast.get_docstring(tree) and exported is not None, f"{face}: a face needs its docstring and __all__"
        readme = (root / package / "README.md").read_text()
        for module in sorted((root / package).glob("*.py")):
            if module.name != "__init__.py":
                assert f"`{module.name}`" in readme, f"{package}/README.md does not name {module.name}"


def test_the_rest_of_vlmprep_and_the_trainer_import_the_stage_packages_by_their_faces():
    """Outside ingest/, pixels/ and render/, a public name is imported from the package, not its module."""
    bad = []
    for f in sorted((REPO / "vlmprep").rglob("*.py")) + sorted((REPO / "trainer").rglob("*.py")):
        rel = f.relative_to(REPO).parts
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if len(parts) == 3 and parts[:2] in (
                    ["vlmprep", "ingest"],
                    ["vlmprep", "pixels"],
                    ["vlmprep", "render"],
                ):
                    if rel[:2] != ("vlmprep", parts[1]) and not all(a.name.startswith("_") for a in node.names):
                        bad.append(f"{'/'.join(rel)}:{node.lineno} from {node.module}")
    assert not bad, "import these names from the package's face:\n" + "\n".join(bad)


def test_every_package_with_an_init_is_in_the_wheel():
    """pyproject.toml lists its packages by name: a new package missing there installs from the source tree (editable)
    and is absent from the wheel, where every import of it fails."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for package in PACKAGES
        for p in (REPO / package).rglob("__init__.py")
    }
    assert found <= listed, f"packages not in pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
