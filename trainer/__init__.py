"""FSDP2 trainer that streams vlmprep shards: read shards -> decode -> collate -> batch -> train step.
Its only contract with vlmprep is the shard format (manifest format_version 1); it never imports vlmprep.
"""
