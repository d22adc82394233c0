"""The shard format, writer and reader paired: `format` holds the one member-name rule (from schemas/),
`writer` encodes samples into tars (build), `reader` is the only code that opens them (verify, stats, inspect,
journal, the client adapters); `dataset` names the dataset dir's files and writes them atomically.
"""
