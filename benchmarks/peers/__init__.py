"""`make bench-peers`: vlmprep beside LLaMA-Factory and ms-swift on the same records (see __main__.py)."""
