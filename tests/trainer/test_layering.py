"""The trainer's import layers (config <- data path <- run): the data path (trainer/data/) never imports the run; from
the config it takes option groups and the few names a component needs, never TrainConfig; the run reaches the data
path through its face (`trainer.data`) only; the trainer never imports vlmprep (their contract is schemas/); and no
function past the run's entry takes the whole TrainConfig."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "trainer"

# The trainer's roles and which roles each may import. base: the options and what everything shares (the family
# registry, file locks); data: trainer/data/, the data path; run: the entry points and what only the run uses.
_ROLES = {
    "base": (
        "trainer",
        "trainer.config",
        "trainer.option_values",
        "trainer.options",
        "trainer.families",
        "trainer.tiny_configs",
        "trainer.locks",
    ),
    "data": ("trainer.data",),
    "run": (
        "trainer.train",
        "trainer.startup",
        "trainer.checkpoint",
        "trainer.export",
        "trainer.follow",
        "trainer.evaluate",
        "trainer.metrics",
        "trainer.model",
        "trainer.plot",
        "trainer.cli",
        "trainer.distributed",
        "trainer.__main__",
    ),
}
_MAY_IMPORT = {"base": {"base"}, "data": {"base", "data"}, "run": {"base", "data", "run"}}
# What the data path takes from trainer.config besides the option groups (trainer.options): never TrainConfig.
DATA_FROM_CONFIG = {"ConfigError", "DataSpec", "cache_limit_bytes", "default"}
# The functions that take a whole TrainConfig: the run's entry, and the option groups' view of it.
TAKE_THE_CONFIG = {"train.py:run", "options.py:OptionGroup.of"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Each import in a file, at any depth (a function's too): (module, names imported from it); `from trainer
    import locks` is the module trainer.locks."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            subs = [a.name for a in node.names if (ROOT / node.module.replace(".", "/") / f"{a.name}.py").is_file()]
            out += [(f"{node.module}.{s}", ()) for s in subs]
            names = tuple(a.name for a in node.names if a.name not in subs)
            out += [(node.module, names)] if names else []
    return out


def _role(module: str) -> str:
    best = max(
        ((p, r) for r, ps in _ROLES.items() for p in ps if module == p or module.startswith(p + ".")),
        key=lambda pr: len(pr[0]),
        default=None,
    )
    assert best is not None, f"{module} has no role in the trainer's layering: add it to _ROLES"
    return best[1]


def _trainer_imports() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    return {_module(p): _imports(p) for p in sorted(TRAINER.rglob("*.py"))}


def test_each_role_imports_only_the_layers_below_it():
    """base <- data <- run: the data path never imports the run (train, checkpoint, export, evaluate, metrics,
    model, plot, cli), and the options import neither."""
    bad = sorted(
        f"{m} ({_role(m)}) imports {d} ({_role(d)})"
        for m, deps in _trainer_imports().items()
        for d, _ in deps
        if d.split(".")[0] == "trainer" and _role(d) not in _MAY_IMPORT[_role(m)]
    )
    assert not bad, "\n".join(bad)


def test_the_data_path_takes_no_whole_config_from_trainer_config():
    bad = sorted(
        f"{m} imports {n} from trainer.config"
        for m, deps in _trainer_imports().items()
        if _role(m) == "data"
        for d, names in deps
        if d == "trainer.config"
        for n in names
        if n not in DATA_FROM_CONFIG
    )
    assert not bad, "\n".join(bad) + f"\nthe data path takes option groups (trainer.options), and {DATA_FROM_CONFIG}"


def test_the_run_reaches_the_data_path_through_its_face():
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in _trainer_imports().items()
        if _role(m) != "data"
        for d, _ in deps
        if d.startswith("trainer.data.")
    )
    assert not bad, "\n".join(bad) + "\nimport it from trainer.data (trainer/data/__init__.py exports it)"


def test_the_trainer_never_imports_vlmprep():
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in _trainer_imports().items()
        for d, _ in deps
        if d == "vlmprep" or d.startswith("vlmprep.")
    )
    assert not bad, "\n".join(bad) + "\ntheir contract is the shard format and schemas/ (vlmprep_schemas)"


def test_no_function_but_the_runs_entry_takes_the_whole_config():
    takers = set()
    for path in sorted(TRAINER.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in [None] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for node in (tree if cls is None else cls).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    a = node.args
                    params = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
                    if any(p.annotation is not None and "TrainConfig" in ast.unparse(p.annotation) for p in params):
                        name = f"{cls.name}.{node.name}" if cls else node.name
                        takers.add(f"{path.relative_to(TRAINER).as_posix()}:{name}")
    assert takers == TAKE_THE_CONFIG, "pass option groups (trainer/options.py) instead of the whole TrainConfig"


@pytest.mark.parametrize(
    "source, ok",
    [
        ("from trainer.train import run", False),
        ("from trainer import locks", True),
        ("from trainer.config import TrainConfig", False),
        ("from trainer.config import ConfigError, default", True),
        ("import vlmprep.shards", False),
        ("from vlmprep_schemas import load", True),
    ],
)
def test_the_checks_see_what_a_data_module_imports(tmp_path, monkeypatch, source, ok):
    path = tmp_path / "planted.py"
    path.write_text(source + "\n")
    monkeypatch.setattr(f"{__name__}._trainer_imports", lambda: {"trainer.data.planted": _imports(path)})
    failed = []
    for check in (
        test_each_role_imports_only_the_layers_below_it,
        test_the_data_path_takes_no_whole_config_from_trainer_config,
        test_the_trainer_never_imports_vlmprep,
    ):
        try:
            check()
        except AssertionError:
            failed.append(check.__name__)
    assert (failed == []) == ok, failed
