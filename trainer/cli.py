"""The trainer's command line: a --config TOML and one --flag per TrainConfig field -> a checked TrainConfig (an
unknown key or flag is one line naming the closest); --help and docs/trainer.md's options table are generated from
the fields' declarations; run_tool gives the subcommands their exit codes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Callable

from trainer.config import FIELDS, GROUPS, REQUIRED, ConfigError, DataSpec, TrainConfig
from vlmprep_schemas.terminal import for_terminal


def _coerce(name: str, value):
    if name in ("data", "eval_data"):
        if isinstance(value, list):
            return tuple(DataSpec.parse(v) for v in value)
        if not isinstance(value, str):
            raise ConfigError(f"{name} = {value!r}: expected a path or [[{name}]] tables")
        return value
    ftype = FIELDS[name].type
    want = {"str": str, "int": int, "float": float, "bool": bool}[ftype]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{name} = {value!r}: expected {ftype}")
    return value


def load_toml(path: str) -> dict:
    """A TOML config file -> its values by field name; unknown keys, and a file that does not parse, are a one-line
    ConfigError."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {', '.join(unknown)}; valid keys: {', '.join(FIELDS)}")
    return {k: _coerce(k, v) for k, v in data.items()}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a VLM on vlmprep shards (FSDP2). "
        "Every option is also a key of the --config TOML (flag without --, _ for -).",
        epilog="Other commands: python -m trainer plot RUN (--help)",
        allow_abbrev=False,
    )
    ap.add_argument(
        "--config",
        metavar="TOML",
        default="",
        help="TOML file of these options; command-line flags override it (default: none)",
    )
    groups = {g: ap.add_argument_group(g, about) for g, about in GROUPS.items()}
    for name, f in FIELDS.items():
        flag, meta = "--" + name.replace("_", "-"), f.metadata
        # default=None: only flags given on the command line override the TOML; --help shows the field's default.
        # A field declared without opt() still parses (tests/trainer/test_train_config.py fails on its missing help).
        shown = "required" if f.default is REQUIRED else f"default: {_show(f.default)}"
        note = f"; {meta['shown']}" if meta.get("shown") else ""
        text = f"{meta.get('help', '')} ({shown}{note})".replace("%", "%%")
        group = groups.get(meta.get("group"), ap)
        if name in ("data", "eval_data"):  # repeatable: one per dataset of a mixture / eval set
            group.add_argument(flag, dest=name, action="append", default=None, metavar="DATA", help=text)
        elif f.type == "bool":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(
                flag,
                dest=name,
                type={"str": str, "int": int, "float": float}[f.type],
                default=None,
                metavar=f.type.upper(),
                help=text,
            )
    return ap


def _show(value) -> str:
    return json.dumps(value)  # TOML spelling: "" for an empty string, true/false


def options_table() -> str:
    """docs/trainer.md's table of trainer options, generated from the field declarations (tests/trainer compares)."""
    rows = ["| group | key (`--flag`) | default | what it does |", "| --- | --- | --- | --- |"]
    for group in GROUPS:
        for name, f in FIELDS.items():
            if f.metadata.get("group") == group:
                default = f.metadata["shown"] or ("required" if f.default is REQUIRED else f"`{_show(f.default)}`")
                flag = ("[no-]" if f.type == "bool" else "") + name.replace("_", "-")
                text = f.metadata["help"].replace("|", "\\|")
                rows.append(f"| {group} | `{name}` (`--{flag}`) | {default} | {text} |")
    return "\n".join(rows) + "\n"


def unknown_argument(extra: list[str], known: list[str]) -> str:
    """The one-line error for arguments argparse does not know, naming the closest option (`--max-step` -> did you
    mean --max-steps?)."""
    first = extra[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r}: every option is --name VALUE (python -m trainer --help lists them)"
    close = difflib.get_close_matches(first.split("=", 1)[0], known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "python -m trainer --help lists the options"
    return f"unknown option {first}: {hint}"


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Command-line arguments (sys.argv[1:] by default) -> a checked TrainConfig: the --config TOML first, then the
    flags over it; an unknown flag is a ConfigError that suggests the closest one."""
    ns, extra = _parser().parse_known_args(argv)
    if extra:
        flags = ["--" + name.replace("_", "-") for name in FIELDS]
        raise ConfigError(
            unknown_argument(
                extra,
                ["--config", "--help"]
                + flags
                + ["--no-" + f[2:] for f, field in zip(flags, FIELDS.values()) if field.type == "bool"],
            )
        )
    values = load_toml(ns.config) if ns.config else {}
    values.update({k: v for k, v in vars(ns).items() if k != "config" and v is not None})
    for key in ("data", "eval_data"):
        if isinstance(values.get(key), list):  # given on the CLI (repeatable)
            values[key] = (
                values[key][0]
                if len(values[key]) == 1 and "path=" not in values[key][0]
                else tuple(DataSpec.parse(v) for v in values[key])
            )
    if "data" not in values:
        raise ConfigError("data is missing: pass --data DIR|PATTERN|URL or set data in the TOML")
    return TrainConfig(**values)


def run_tool(prog: str, work: Callable[[], object]) -> int:
    """A subcommand's exit code: 0 after printing `PROG: wrote OUT` (OUT: what `work` returns), 1 after one
    `PROG: error: ...` line for a ConfigError (its traceback only with TRAINER_DEBUG set)."""
    try:
        out = work()
    except ConfigError as e:
        if os.environ.get("TRAINER_DEBUG"):
            raise
        print(for_terminal(f"{prog}: error: {e}"), file=sys.stderr)
        return 1
    print(f"{prog}: wrote {out}")
    return 0
