"""The option values that are more than a number, parsed and checked for TrainConfig (config.py): a dataset of a
mixture (`--data name=N,path=P,weight=W` / `[[data]]` -> DataSpec), a mixture's names and weights, and a size like
50GB (--shard-cache-limit); a bad one is a ConfigError.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass


class ConfigError(ValueError):
    """A bad option or config file: reported as one line, exit code 1."""


ON_END = ("repeat", "stop")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """One dataset of a mixture: `[[data]]` in the TOML, `--data name=N,path=P,weight=W,on_end=E` on the CLI."""

    path: str
    name: str = ""
    weight: float = 1.0  # share of the run's trained tokens (normalized over the sources)
    on_end: str = "repeat"  # when the source runs out before the epoch ends: start it again, or leave it out

    @classmethod
    def parse(cls, value) -> "DataSpec":
        """One --data value (a path or URL, or name=N,path=P[,weight=W][,on_end=...]), or a [[data]] table -> a
        DataSpec; bad keys or values are a ConfigError."""
        if isinstance(value, DataSpec):
            return value
        if isinstance(value, str):
            if "=" not in value.split("/", 1)[0] or "path=" not in value:
                return cls(path=value)
            parts = dict(p.split("=", 1) if "=" in p else (p, "") for p in value.split(","))
            value = {k.strip(): v.strip() for k, v in parts.items()}
            if "weight" in value:
                try:
                    value["weight"] = float(value["weight"])
                except ValueError:
                    raise ConfigError(f"--data {value}: weight must be a number") from None
        if not isinstance(value, dict):
            raise ConfigError(f"data entry {value!r}: expected a path or a table with name, path, weight, on_end")
        unknown = sorted(set(value) - {"path", "name", "weight", "on_end"})
        if unknown or "path" not in value:
            raise ConfigError(
                f"data entry {value!r}: {'unknown keys ' + ', '.join(unknown) if unknown else 'no path'}"
                "; keys: name, path, weight, on_end"
            )
        if isinstance(value.get("weight"), int) and not isinstance(value.get("weight"), bool):
            value = {**value, "weight": float(value["weight"])}
        spec = cls(**value)
        if not isinstance(spec.path, str) or not spec.path or not isinstance(spec.name, str):
            raise ConfigError(f"data entry {value!r}: path and name must be non-empty strings")
        if "name" in value and not spec.name.strip():
            raise ConfigError(
                f"data entry path={spec.path}: its name is empty: name it (name=N: letters, digits, "
                "'_', '-', '.'), or leave name out for a single dataset"
            )
        w = spec.weight
        # Subnormal weights lose their precision and overflow the order's token / weight clocks to inf.
        if not isinstance(w, float) or not math.isfinite(w) or w < sys.float_info.min:
            raise ConfigError(
                f"data entry {spec.name or spec.path}: weight={w!r} must be a finite number > 0 (not "
                f"below {sys.float_info.min:.3g}), e.g. weight=0.3: its share of the trained tokens"
            )
        if spec.on_end not in ON_END:
            raise ConfigError(
                f"data entry {spec.name or spec.path}: on_end={spec.on_end!r}: choose {' or '.join(ON_END)}"
            )
        return spec

    def to_toml(self, table: str = "data") -> str:
        """This dataset as one [[data]] (or [[`table`]]) TOML table."""
        return f"\n[[{table}]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in dataclasses.asdict(self).items())


def _specs(value: str | tuple[DataSpec, ...]) -> tuple[DataSpec, ...]:
    if isinstance(value, str):
        return (DataSpec(path=value),) if value else ()
    return value


class DataSources:
    """The datasets of a config or option group with `data` and `eval_data` fields, as DataSpecs."""

    @property
    def sources(self) -> tuple[DataSpec, ...]:
        """The run's datasets: one unnamed for a plain --data, else the named mixture."""
        return _specs(self.data)

    @property
    def eval_sources(self) -> tuple[DataSpec, ...]:
        """The eval sets: none, one unnamed, or the named ones."""
        return _specs(self.eval_data)


_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def cache_limit_bytes(value: str) -> int:
    """'50GB' -> 50 * 10**9 (KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, a plain number is bytes); '' -> 0 (none)."""
    if not value:
        return 0
    m = _SIZE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"shard_cache_limit={value!r}: a size like 50GB, 500MiB or 2000000000 (bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_mixture(key: str, specs: tuple[DataSpec, ...]) -> None:
    """A mixture of `key` (data or eval_data): a distinct name each (letters, digits, '_', '-', '.') and weights
    on one scale; else a ConfigError that says how to name them."""
    names = [d.name for d in specs]
    how = f"--{key.replace('_', '-')} name=N,path=P[,weight=W] for each, or [[{key}]] name = ... in the TOML"
    unnamed = [d.path for d in specs if not d.name]
    if unnamed:
        raise ConfigError(f"{key} entry path={unnamed[0]} has no name: several datasets need a name each: " + how)
    twice = sorted(n for n, c in collections.Counter(names).items() if c > 1)
    if twice:
        raise ConfigError(
            f"dataset name {twice[0]!r} is given {names.count(twice[0])} times: several "
            f"datasets need distinct names: {how}"
        )
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ConfigError(f"dataset name {bad[0]!r}: letters, digits, '_', '-', '.' only")
    total = sum(d.weight for d in specs)
    light = min(specs, key=lambda d: d.weight)
    if not math.isfinite(total) or light.weight / total < sys.float_info.min:
        raise ConfigError(
            f"{key} weights span too wide a range ({light.name} {light.weight:g} of a sum "
            f"of {total:g}): give them on one scale, e.g. shares that add up to 1"
        )
