"""Storage: local or ``gs://`` paths, output folders, atomic writes, input listing.

One module per concern; this package is their API (``storage.join``, ``storage.atomic_write_json``,
``storage.expand_inputs``, ...). Reading rows out of data files is :mod:`refinery.transforms.io.rows`.

- :mod:`.paths`: reach and read a file whatever its scheme; :func:`offline` for dry runs.
- :mod:`.outputs`: whether a path can be an output folder; removal that stays inside it.
- :mod:`.atomic`: writes whose final name holds all or nothing; temp files of dead writers.
- :mod:`.inputs`: the data files named by files, folders and globs.
"""
from .atomic import (
    TEMP_NAME,
    TMP_MARKER,
    AtomicGroup,
    BinaryWriter,
    HashingWriter,
    atomic_group,
    atomic_open,
    atomic_write_bytes,
    atomic_write_json,
    find_temp_files,
    is_temp_name,
    remove_dead_temp_files,
    sha256_file,
    temp_name,
    temp_writer_dead,
)
from .inputs import (
    DATA_SUFFIXES,
    InputFile,
    expand_inputs,
    file_identity,
    has_data_suffix,
    listing_reaches,
    one_per_file,
    saved_dataset_files,
    skipped_note,
)
from .outputs import (
    RUN_MARKERS,
    PathError,
    folders_holding,
    output_folder_problem,
    remove,
    remove_empty_folder,
    remove_tree,
    runs_above,
)
from .paths import (
    InputError,
    Offline,
    RemoteNotRead,
    basename,
    dirname,
    exists,
    file_size,
    filesystem,
    has_suffix,
    is_remote,
    isdir,
    join,
    listdir,
    offline,
    offline_state,
    open_read,
    read_bytes,
    read_json,
    read_range,
    resolved,
    safe_relpath,
)

__all__ = [
    "TEMP_NAME", "TMP_MARKER", "AtomicGroup", "BinaryWriter", "HashingWriter", "atomic_group", "atomic_open",
    "atomic_write_bytes",
    "atomic_write_json",
    "find_temp_files", "is_temp_name", "remove_dead_temp_files", "sha256_file", "temp_name", "temp_writer_dead",
    "DATA_SUFFIXES", "InputFile", "expand_inputs", "file_identity", "has_data_suffix", "listing_reaches",
    "one_per_file", "saved_dataset_files",
    "skipped_note", "RUN_MARKERS", "PathError", "folders_holding", "output_folder_problem", "remove",
    "remove_empty_folder", "remove_tree", "runs_above",
    "InputError", "Offline", "RemoteNotRead", "basename", "dirname", "exists", "file_size", "filesystem",
    "has_suffix", "is_remote", "isdir", "join", "listdir", "offline", "offline_state", "open_read", "read_bytes",
    "read_json", "read_range", "resolved", "safe_relpath",
]
