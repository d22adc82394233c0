"""vlmprep: offline, checkable VLM SFT data preparation (chat traces -> rendered, masked WebDataset shards)."""

__version__ = "0.1.0"
