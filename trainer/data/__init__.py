"""The trainer's data path, as the run sees it: --data URLs -> shard lists and sample indexes -> each rank's order
-> checked, cached shards -> decoded samples -> the micro-batches of a step (README.md has the map, one line per
module). The run imports these names only; the stages behind them are this package's modules.
"""

import importlib

# Each name -> the module that holds it, imported on first use (PEP 562): importing one stage (`trainer.data.sources`
# for a dataset's manifest) must not import every stage and torch with it.
_FACE = {
    "StepLoader": "batches",
    "IGNORE_INDEX": "collate",
    "Batch": "collate",
    "CollateSpec": "collate",
    "keep_freed_buffers": "collate",
    "token_sources": "collate",
    "RunData": "datasets",
    "log_plans": "datasets",
    "open_data": "datasets",
    "processor_dir": "datasets",
    "trains_videos": "decode",
    "DataError": "errors",
    "check_packing": "pack",
    "empty_state": "pack",
    "EvalSet": "pipeline",
    "ReadPlan": "pipeline",
    "eval_loaders": "pipeline",
    "make_loader": "pipeline",
    "read_plan": "pipeline",
    "load_processor": "processors",
    "local_processor": "processors",
    "resolve_data": "sources",
    "set_read_timeout": "storage",
    "Patchifier": "vision",
    "check_pins": "pins",
    "epoch_entry": "pins",
    "newer_version": "pins",
    "run_versions": "pins",
    "reopen": "datasets",
    "replaced_samples": "datasets",
    "data_streams": "pipeline",
    "host_pixels": "vision",
}


def __getattr__(name: str):
    if name not in _FACE:
        raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer.data.{_FACE[name]}"), name)


__all__ = [
    # the run's data, assembled (datasets.py, pipeline.py)
    "RunData",
    "open_data",
    "log_plans",
    "processor_dir",
    "ReadPlan",
    "read_plan",
    "make_loader",
    "StepLoader",
    "EvalSet",
    "eval_loaders",
    # what a step holds, and what the model and its collate spec need of the data
    "Batch",
    "CollateSpec",
    "IGNORE_INDEX",
    "token_sources",
    "keep_freed_buffers",
    "trains_videos",
    "host_pixels",
    "load_processor",
    "local_processor",
    "Patchifier",
    # packing's checks and its empty carry-over
    "check_packing",
    "empty_state",
    # reading: a dataset by its URL, the remote read timeout, the one error
    "resolve_data",
    "set_read_timeout",
    # the dataset versions a run reads, as RUN/run.json records them (pins.py)
    "check_pins",
    "epoch_entry",
    "newer_version",
    "run_versions",
    "reopen",
    "replaced_samples",
    "data_streams",
    "DataError",
]
