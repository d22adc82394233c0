"""The trainer's data path: --data URLs -> shard lists and sample indexes -> each rank's order -> checked, cached
shards -> decoded samples -> micro-batches of a step (trainer/data/README.md has the map)."""
