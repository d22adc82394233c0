"""Zero-glue readers of vlmprep datasets for other libraries: `wds` (webdataset), `hf` (HF datasets), `energon`
(Megatron-Energon; `energon_meta` writes its dataset.yaml at build time). Each imports its library itself, so
`import vlmprep` never needs them.
"""
