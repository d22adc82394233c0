"""The trainer's data path, as the run sees it: --data URLs -> shard lists and sample indexes -> each rank's order
-> checked, cached shards -> decoded samples -> the micro-batches of a step (README.md has the map, one line per
module). The run imports these names only; the stages behind them are this package's modules.
"""
from trainer.data.batches import StepLoader
from trainer.data.collate import IGNORE_INDEX, Batch, CollateSpec, keep_freed_buffers, token_sources
from trainer.data.datasets import RunData, log_plans, open_data, processor_dir
from trainer.data.decode import trains_videos
from trainer.data.errors import DataError
from trainer.data.pack import check_packing, empty_state
from trainer.data.pipeline import EvalSet, ReadPlan, eval_loaders, make_loader, read_plan
from trainer.data.processors import load_processor
from trainer.data.sources import resolve_data
from trainer.data.storage import set_read_timeout
from trainer.data.vision import Patchifier, host_pixels

__all__ = [
    # the run's data, assembled (datasets.py, pipeline.py)
    "RunData", "open_data", "log_plans", "processor_dir", "ReadPlan", "read_plan", "make_loader", "StepLoader",
    "EvalSet", "eval_loaders",
    # what a step holds, and what the model and its collate spec need of the data
    "Batch", "CollateSpec", "IGNORE_INDEX", "token_sources", "keep_freed_buffers", "trains_videos", "host_pixels",
    "load_processor", "Patchifier",
    # packing's checks and its empty carry-over
    "check_packing", "empty_state",
    # reading: a dataset by its URL, the remote read timeout, the one error
    "resolve_data", "set_read_timeout", "DataError",
]
