"""How a config option is declared (BuildConfig, InspectConfig): opt() gives a field its help, its --help panel, its
flag and checks; Spelled says how its text on the command line becomes the value and back (--train-on-roles,
--keep-images). The CLI's options are generated from these declarations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

ROLES = ("system", "user", "assistant", "tool")
# The --help panels, in this order (a panel first shows where its first option is declared).
INPUT, RENDER, IMAGES, AGENT = "Input", "Rendering and masks", "Images", "Agent traces"
LIMITS, OUTPUT, SCALE = "Limits", "Output", "Scale-out"
GROUPS = (OUTPUT, INPUT, RENDER, IMAGES, AGENT, LIMITS, SCALE)
OWN = ""  # typer's own "Options" panel: inspect's options, before the build options it takes


def parse_roles(value: str) -> tuple[str, ...]:
    """--train-on-roles text -> roles; a ValueError names the fix."""
    roles = tuple(r.strip() for r in value.split(",") if r.strip())
    if not roles or set(roles) - set(ROLES):
        raise ValueError(f"{value!r}: use a comma list of {', '.join(ROLES)}, e.g. assistant,tool")
    return roles


def parse_keep_images(value: str) -> int | None:
    """--keep-images text -> N (last:N) or None (all)."""
    if value == "all":
        return None
    head, _, n = value.partition(":")
    if head != "last" or not n.isdigit():
        raise ValueError(f"--keep-images {value!r}: use all or last:N, e.g. last:3")
    return int(n)


def show_keep_images(value: int | None) -> str:
    """--keep-images as typed: the inverse of parse_keep_images."""
    return "all" if value is None else f"last:{value}"


@dataclass(frozen=True)
class Spelled:
    """How an option is typed when its value is not the text itself: `parse` turns the flag's text into the value,
    `show` the value back into that text (default str), `default` is the default as typed (`all`, `assistant`)."""

    parse: Callable[[str], Any]
    default: str
    show: Callable[[Any], str] | None = None


def opt(
    default,
    group: str | None,
    text: str,
    *,
    flag: str = "",
    choices: tuple[str, ...] = (),
    spelled: Spelled | None = None,
    cli_type=None,
    bounds: tuple[float, float] | None = None,
):
    """A BuildConfig (or InspectConfig) field with its one declaration of docs: `text` and `group` feed the command's
    --help (group None: a library-only field, no flag; OWN: a command's own options, in --help's first panel). `flag`
    overrides --field-name; `choices` are checked at parse time; `spelled` says how the flag's text becomes the value
    and back; `cli_type` overrides the flag's type; `bounds` is a checked range."""
    assert group in GROUPS + (OWN, None) and text, f"option needs a group from {GROUPS} and a help text"
    return dataclasses.field(
        default=default,
        metadata={
            "group": group,
            "help": text,
            "flag": flag,
            "choices": choices,
            "parse": spelled and spelled.parse,
            "spelled": spelled and spelled.default,
            "show": spelled and spelled.show,
            "cli_type": cli_type,
            "bounds": bounds,
        },
    )


ROLE_LIST = Spelled(parse_roles, "assistant")  # --train-on-roles assistant,tool
KEEP_IMAGES = Spelled(parse_keep_images, "all", show_keep_images)  # --keep-images all | last:N
