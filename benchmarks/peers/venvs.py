"""One virtual environment per peer under bench-out/peers/: the project venv's torch linked in (hard links: no copy,
no download), then the peer's pinned release from PyPI with its own dependency pins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from importlib.metadata import Distribution, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Each peer: its PyPI release, what pip installs beside it, and the requirements of its metadata left out: torchaudio
# because no release can sit beside the project's torch (see NO_DEPS), gradio because only LLaMA-Factory's web UI
# imports it and pip spent minutes backtracking through its releases.
PEERS = {
    "llamafactory": {"pin": "llamafactory==0.9.5", "extra": [], "skip": {"torchaudio", "gradio"}},
    "ms-swift": {"pin": "ms-swift==4.6.0", "extra": ["qwen-vl-utils==0.0.14"], "skip": set()},
}
# llamafactory 0.9.5 imports torchaudio at the top of its multimodal plugin (audio only), and every torchaudio
# release pins one torch (2.11.0, the newest, wants torch==2.11.0): the newest is installed without its pin.
NO_DEPS = {"llamafactory": ["torchaudio==2.11.0"]}


def torch_closure() -> list[Distribution]:
    """torch with everything it requires (its CUDA libraries included) and torchvision, as installed here."""
    env = default_environment()
    seen: dict[str, Distribution] = {}
    todo = [("torch", frozenset()), ("torchvision", frozenset())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not extras:
            continue
        try:
            dist = distribution(name)
        except ModuleNotFoundError:
            continue
        seen[key] = dist
        if key == "torchvision":  # its numpy and pillow come from the peer's own pins
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return list(seen.values())


def link_torch(site: Path) -> list[str]:
    """Hard-link the torch closure's files (and dist-info) into a venv's site-packages, so pip sees torch installed
    and never fetches a CUDA build; a pip uninstall there removes only the links."""
    linked = []
    for dist in torch_closure():
        root = Path(dist.locate_file(""))
        for rel in dist.files or []:
            src = root / rel
            dst = site / rel
            if not str(dst.resolve()).startswith(str(site.resolve())) or not src.is_file():
                continue  # console scripts (../../bin) are not needed
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
        linked.append(f"{dist.metadata['Name']}=={dist.version}")
    return sorted(linked)


def pip(py: Path, *args: str, log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"$ {py} -m pip {' '.join(args)}\n")
        f.flush()
        res = subprocess.run([str(py), "-m", "pip", *args], stdout=f, stderr=subprocess.STDOUT)
    if res.returncode:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"pip {' '.join(args)} failed (log {log}):\n" + "\n".join(tail))


def requirements(pin: str, skip: set[str], py: Path) -> list[str]:
    """The peer's own Requires-Dist (no extras), less the skipped ones; read from its wheel's metadata in the venv."""
    code = (
        "import json, importlib.metadata as m; print(json.dumps(m.distribution(%r).requires or []))"
        % pin.split("==")[0]
    )
    import json

    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True).stdout
    keep = []
    for line in json.loads(out):
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) not in skip:
            keep.append(str(req).split(";")[0].strip())
    return keep


def ensure(peer: str, root: Path) -> Path:
    """The peer's venv python, created and installed on first use (a marker file records a finished install)."""
    spec = PEERS[peer]
    d = root / f"venv-{peer}"
    py = d / "bin" / "python"
    stamp = d / ".installed"
    want = " ".join([spec["pin"], *spec["extra"], *NO_DEPS.get(peer, [])])
    if stamp.exists() and stamp.read_text() == want:
        return py
    shutil.rmtree(d, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(d)
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    linked = link_torch(site)
    log = d / "install.log"
    cons = d / "constraints.txt"
    cons.write_text("".join(f"{p}\n" for p in linked if p.split("==")[0] in ("torch", "torchvision")))
    print(
        f"[peers] {peer}: venv {d}, torch linked ({len(linked)} dists); pip install {want} (log {log})",
        file=sys.stderr,
        flush=True,
    )
    pip(py, "install", "-c", str(cons), "--no-deps", spec["pin"], log=log)
    pip(py, "install", "-c", str(cons), *requirements(spec["pin"], spec["skip"], py), *spec["extra"], log=log)
    for extra in NO_DEPS.get(peer, []):
        pip(py, "install", "--no-deps", extra, log=log)
    stamp.write_text(want)
    return py
