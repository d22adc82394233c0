"""A .npy header parsed once is remembered by its bytes (vlmprep_schemas.limits.npy_header): the answer is the parse's,
and every check that follows the header still runs on each member."""

import io

import numpy as np
import pytest

from vlmprep_schemas import limits
from vlmprep_schemas.limits import load_npy, npy_header


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_a_remembered_header_gives_the_parse_and_the_checks_after_it_still_run(monkeypatch):
    monkeypatch.setattr(limits, "_NPY_PARSED", {})
    data = _npy(np.arange(7, dtype=np.int32))
    first = npy_header(data, "a.npy")
    assert limits._NPY_PARSED and npy_header(data, "a.npy") == first == ("<i4", False, (7,), len(data) - 28)
    np.testing.assert_array_equal(load_npy(data, "a.npy", np.int32, (7,)), np.arange(7))
    with pytest.raises(ValueError, match="holds 24 bytes of data, its header declares 28"):
        load_npy(data[:-4], "a.npy", np.int32, (7,))  # the same header, its data cut short
    with pytest.raises(ValueError, match="declares shape"):
        load_npy(data, "a.npy", np.int32, (8,))  # the meta asks for another shape
    with pytest.raises(ValueError, match="no .npy header"):
        npy_header(data[:40], "a.npy")  # the header itself cut: another key, parsed, refused
    bad = data.replace(b"'<i4'", b"'|O4'")
    with pytest.raises(ValueError, match="Python objects"):
        load_npy(bad, "a.npy", np.int32, (7,))


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(limits, "_NPY_PARSED", {})
    for n in range(9000):
        npy_header(_npy(np.zeros(n, np.uint8)), "m.npy")
    assert 0 < len(limits._NPY_PARSED) <= 8192
