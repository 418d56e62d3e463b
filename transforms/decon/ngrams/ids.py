"""Names and ids: an eval file's (or row's) dataset name, a row's id."""
from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

import msgpack

_DATA_FILE_RE = re.compile(r"\.(jsonl|json|parquet)(\.gz|\.zst)?$")
_HEX_SUFFIX_RE = re.compile(r"-[0-9a-f]{6}$")


def eval_dataset_name(path: str) -> str:
    """``decontamination/gsm8k-dolma-3fa9c1/test.jsonl`` -> ``gsm8k``.

    Basename; for a data file (``.jsonl``/``.json``/``.parquet``, optionally ``.gz``/``.zst``)
    its parent folder's name instead; strip ``-`` + 6 lowercase hex chars; strip ``-dolma``.
    """
    parts = [p for p in path.rstrip("/").split("/") if p]
    name = parts[-1] if parts else path
    if _DATA_FILE_RE.search(name) and len(parts) >= 2:
        name = parts[-2]
    name = _HEX_SUFFIX_RE.sub("", name)
    if name.endswith("-dolma"):
        name = name[: -len("-dolma")]
    return name


def dataset_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an eval dataset's name, or None. A name is what
    :func:`eval_dataset_name` gives: one path component (a dataset's output files may be
    named by it, and reports show it on a line): not empty, not ``.`` or
    ``..``, no ``/`` or ``\\``, no control character, no space at either end, at most
    200 bytes in UTF-8."""
    if not name:
        return "empty"
    if name in (".", ".."):
        return f"{name!r} is not a name"
    if bad := next((c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127), None):
        return f"{name!r} has {bad!r} (a dataset name is one path component)"
    if name != name.strip():
        return f"{name!r} begins or ends with a space"
    if len(name.encode("utf-8", "surrogatepass")) > 200:
        return f"{name[:40]!r}... is over 200 bytes"
    return None


def field_dataset(record: object, field: str) -> tuple[str | None, str | None]:
    """``(dataset, None)``: the eval dataset a row names in its ``field``
    (``refinery decon --eval-dataset-field``); else ``(None, reason)``, the reason naming the
    field: no such field, not a string, or not a name (:func:`dataset_name_problem`)."""
    if not isinstance(record, dict):
        return None, f"not a row: a {type(record).__name__}, expected a JSON object"
    if field not in record:
        return None, f"no field {field!r} (--eval-dataset-field)"
    value = record[field]
    if not isinstance(value, str):
        return None, f"field {field!r} (--eval-dataset-field) is {type(value).__name__}, not a string"
    if problem := dataset_name_problem(value):
        return None, f"field {field!r} (--eval-dataset-field): {problem}"
    return value, None


_NESTED = (dict, list, tuple)


def sort_keys_recursive(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: sort_keys_recursive(v) if isinstance(v, _NESTED) else v for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [sort_keys_recursive(v) for v in obj]
    return obj


_ID_PACKERS = threading.local()  # one msgpack Packer per thread: packb builds a new one per call


def record_hash_id(record: dict[str, Any]) -> str:
    """blake2b-64 (decimal) of the msgpack of the recursively key-sorted record. Values msgpack
    cannot encode (a parquet timestamp or decimal) are hashed as their ``str()``."""
    packer = getattr(_ID_PACKERS, "packer", None)
    if packer is None:
        packer = _ID_PACKERS.packer = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass", default=str)
    packed = packer.pack(sort_keys_recursive(record))
    return str(int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "big"))


def record_id(record: dict[str, Any], id_field: str = "id") -> str:
    """``str(record[id_field])`` when present and not None, else :func:`record_hash_id` of
    the whole record as read (every field, ``"id": null`` included)."""
    value = record.get(id_field)
    if value is not None:
        return str(value)
    return record_hash_id(record)


def shown_id(instance_id: str, eval_path: str, eval_row: int, hashed: bool) -> str:
    """The id the reports show for an eval row: its own id, or for a row without one (whose
    ``instance_id`` is a 20-digit hash) its file's name and row number, ``test.jsonl:12``
    (rows count from 0). The stats and details keep ``instance_id``."""
    return f"{eval_path.rstrip('/').rsplit('/', 1)[-1]}:{eval_row}" if hashed else instance_id
