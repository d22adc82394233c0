"""One JSON line per measurement on stdout, so `make bench` output can be grepped, diffed and plotted."""

from __future__ import annotations

import json
import os
import platform
import sys


def emit(bench: str, **fields) -> dict:
    row = {"bench": bench, **fields}
    print(json.dumps(row, sort_keys=False), flush=True)
    return row


def machine() -> dict:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "argv": " ".join(sys.argv),
    }
