"""A failed run's record, ``OUTPUT/FAILED.json``: what a run leaves when its units all finished
but its verdict failed it (corrupt or cut-short input files, more rejected rows than
``--max-reject-rate``, no row accepted), instead of what marks a finished run (prep's
``manifest.json``, decon's ``.SUCCESS``), so that no reader takes it for a finished one.

``{"schema": "refinery.failed/1", "command", "failure": the line the run exited 1 with,
"corrupt_files": [{"path", "reason"}]}`` (docs/FORMATS.md). The run that fails writes it and
then removes its finish marker; a run of the same output that passes removes it. Every reader
of a finished run (``verify``, ``info``, the loader, ``--exclude-overlaps``) refuses an output
holding one, with :func:`failed_line`.
"""
from __future__ import annotations

import json
from typing import TypedDict

from refinery.transforms.io import storage

FAILED = "FAILED.json"
SCHEMA = "refinery.failed/1"
SHOWN = 3  # corrupt files named in a line


class CorruptFile(TypedDict):
    path: str
    reason: str


class FailedRun(TypedDict):
    schema: str
    command: str
    failure: str
    corrupt_files: list[CorruptFile]


class FailedRunError(ValueError):
    """An output whose run failed (its ``FAILED.json``): the message is :func:`failed_line`."""


def mark_failed(output: str, command: str, failure: str, corrupt_files: list[CorruptFile]) -> None:
    """Record that the run of ``command`` into ``output`` failed (written atomically; the caller
    removes the finish marker after it, so that a kill in between still leaves a failed run)."""
    record: FailedRun = {"schema": SCHEMA, "command": command, "failure": failure,
                         "corrupt_files": sorted(corrupt_files, key=lambda c: c["path"])}
    storage.atomic_write_bytes(storage.join(output, FAILED), (json.dumps(record, indent=2) + "\n").encode())


def clear_failed(output: str) -> None:
    """A run of ``output`` that passed: no record of an earlier failure stays."""
    storage.remove(storage.join(output, FAILED), root=output)


def read_failed(output: str) -> FailedRun | None:
    """``output``'s failed-run record, or None when its run did not fail. A record that cannot
    be read still says the run failed (its failure says why it is unreadable)."""
    path = storage.join(output, FAILED)
    try:
        data = storage.read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        data = {"failure": f"{path} is unreadable ({e})"}
    if not isinstance(data, dict):
        data = {"failure": f"{path} is not a JSON object"}
    corrupt = data.get("corrupt_files")
    files: list[CorruptFile] = [{"path": str(c.get("path")), "reason": str(c.get("reason"))}
                                for c in (corrupt if isinstance(corrupt, list) else []) if isinstance(c, dict)]
    return {"schema": str(data.get("schema", SCHEMA)), "command": str(data.get("command", "")),
            "failure": str(data.get("failure", "")), "corrupt_files": files}


def failed_line(output: str, record: FailedRun) -> str:
    """One line: ``output`` holds a failed run, why, and its corrupt input files (the first
    :data:`SHOWN`, then how many more)."""
    corrupt = record["corrupt_files"]
    named = ", ".join(c["path"] for c in corrupt[:SHOWN]) + \
        (f" and {len(corrupt) - SHOWN} more" if len(corrupt) > SHOWN else "")
    command = f"refinery {record['command']}".strip()
    return (f"{output}: the {command} run failed ({storage.join(output, FAILED)}): {record['failure']}"
            + (f" [corrupt input file(s): {named}]" if corrupt else "")
            + "; it is no finished output: fix the cause and run the same command again")


def refuse_failed(output: str) -> None:
    """:class:`FailedRunError` when ``output`` holds a failed run."""
    if (record := read_failed(output)) is not None:
        raise FailedRunError(failed_line(output, record))
