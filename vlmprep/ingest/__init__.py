"""Ingest, the first stage of a build: input files and objects -> raw records -> one Conversation each
(README.md has the flow, one line per module). The rest of vlmprep imports these names only.
"""

from vlmprep.ingest.locations import (
    READ_BLOCK,
    Input,
    LocationError,
    RemoteFile,
    as_input,
    is_url,
    size_of,
    stamp,
    stamp_of_info,
    url_fs,
    why,
)
from vlmprep.ingest.normalize import (
    NormalizeOptions,
    assistant_turns,
    generated_id,
    normalize_record,
)
from vlmprep.ingest.records import (
    SUFFIXES,
    InputError,
    ReadLimits,
    Seek,
    expand_inputs,
    input_names,
    iter_file_records,
    iter_records,
    parse_record,
    readable_record,
)

__all__ = [
    "Input",
    "InputError",
    "LocationError",
    "NormalizeOptions",
    "READ_BLOCK",
    "ReadLimits",
    "RemoteFile",
    "SUFFIXES",
    "Seek",
    "as_input",
    "assistant_turns",
    "expand_inputs",
    "generated_id",
    "input_names",
    "is_url",
    "iter_file_records",
    "iter_records",
    "normalize_record",
    "parse_record",
    "readable_record",
    "size_of",
    "stamp",
    "stamp_of_info",
    "url_fs",
    "why",
]
