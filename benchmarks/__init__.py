"""vlmprep benchmarks: each module prints JSON lines; `python -m benchmarks.run` runs them all."""
