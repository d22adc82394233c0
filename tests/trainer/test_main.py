"""The trainer's command line: `python -m trainer` and the installed `vlmprep-train` run the same dispatch."""

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_vlmprep_train_script_is_the_module_main_and_dispatches_its_tools(capsys):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["vlmprep-train"].partition(":")
    main = getattr(importlib.import_module(module), name)
    for argv, usage in ((["--help"], "--max-steps"), (["plot", "--help"], "RUN"), (["export", "--help"], "--step")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
        assert usage in capsys.readouterr().out, argv


def test_python_m_trainer_runs_the_same_main():
    res = subprocess.run(
        [sys.executable, "-m", "trainer", "plot", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert res.returncode == 0 and "usage: python -m trainer plot" in res.stdout, res.stderr
