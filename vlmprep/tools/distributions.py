"""A per-sample (or per-image) count -> its distribution as stats shows it: mean, min, nearest-rank percentiles, max
and an equal-width histogram.
"""

from __future__ import annotations

import numpy as np

HIST_BINS = 10
PERCENTILES = (10, 50, 90, 99)
DISTRIBUTIONS = {
    "tokens_per_sample": "tokens per sample",
    "trained_tokens_per_sample": "trained tokens per sample",
    "images_per_sample": "images per sample",
    "tokens_per_image": "tokens per image",
}


def _pct(x: np.ndarray, q: float) -> int:
    # Nearest rank: always a value that some sample really has.
    return int(np.percentile(x, q, method="inverted_cdf")) if len(x) else 0


def _histogram(x: np.ndarray, bins: int = HIST_BINS) -> list[dict]:
    """Equal-width integer bins [lo, hi) over min..max."""
    if not len(x):
        return []
    lo, hi = int(x.min()), int(x.max())
    width = max(1, -(-(hi - lo + 1) // bins))
    counts = np.bincount((x - lo) // width, minlength=bins)
    n = int(np.flatnonzero(counts).max()) + 1
    return [{"lo": lo + i * width, "hi": lo + (i + 1) * width, "count": int(counts[i])} for i in range(n)]


def distribution(values: list[int]) -> dict:
    """Mean, min, nearest-rank percentiles, max and the histogram of one per-sample (or per-image) count."""
    x = np.asarray(values, dtype=np.int64)
    n = len(x)
    return {
        "count": n,
        "mean": float(x.mean()) if n else 0.0,
        "min": int(x.min()) if n else 0,
        **{f"p{q}": _pct(x, q) for q in PERCENTILES},
        "max": int(x.max()) if n else 0,
        "histogram": _histogram(x),
    }
