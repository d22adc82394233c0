"""The data path's one error: DataError, for data that cannot be read, does not add up or is not safe to read. Its
message is the one line the trainer prints (naming the URL, and the sample, that failed)."""

from __future__ import annotations


class DataError(RuntimeError):
    """Unreadable, inconsistent or unsafe data; the message names the URL (and sample) that failed."""
