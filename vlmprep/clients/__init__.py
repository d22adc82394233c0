"""Zero-glue readers of vlmprep datasets for other libraries (webdataset, HF datasets, Megatron-Energon)."""
