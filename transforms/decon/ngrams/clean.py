"""Clean eval subsets: per eval dataset and n, the eval rows that no training row overlaps.

``stats/clean/<dataset>/n=<n>.jsonl.gz`` (:func:`clean_file`) holds, in eval order (eval files
in decon's order, rows in file order), each eval row of the dataset that decon checked and
found no overlap for at n, as it was read again from its eval file: the record with all its
fields, plus ``"instance_id"`` (:data:`ID_KEY`) only for a row without an id (its
``--id-field`` missing or null: decon's id is the hash of the record, :func:`.ids.record_id`).

Clean is a property of an instance id (``overlap_stats.jsonl`` counts ids): an id is clean at
n when it is not among the ids overlapping at n and no row of it went unchecked. Unchecked
rows are those decon never looked up: an empty (punctuation-only) row and a row of fewer than
``--min-eval-tokens`` tokens (:func:`.index.short_rows`). Rows without text or unreadable are
not instances (``eval_summary.jsonl``'s ``num_bad_rows``) and are in no clean file. Per
(dataset, n) the ids split exactly: ``num_clean_instances + len(instance_ids) +
num_unchecked_instances == num_instances`` (:func:`note_clean`).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import re
from collections import defaultdict
from typing import IO, Any, Callable, ContextManager, Iterable, Iterator, cast

from refinery.transforms.io import storage
from refinery.transforms.io.jsonl import JSON_ERRORS
from refinery.transforms.io.rows import Row, iter_rows

from .ids import record_id
from .index import EvalRow, short_rows

CLEAN_DIR = "stats/clean"
ID_KEY = "instance_id"  # the key a clean row without an id gets its decon id under
CLEAN_NAME = re.compile(r"n=\d+\.jsonl\.gz")  # the names decon writes in a dataset's folder


def clean_dir_name(dataset: str) -> str:
    """``dataset`` as one folder name: as it is, but with ``/``, ``\\``, ``%`` and control
    characters ``%``-escaped (``a/b`` -> ``a%2Fb``), and ``""``, ``.`` and ``..`` as ``%2E``s."""
    name = UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8", "surrogatepass")), dataset)
    return (name.replace(".", "%2E") or "%2E") if name in ("", ".", "..") else name


UNSAFE = re.compile(r"[/\\%\x00-\x1f\x7f]")


def clean_file(dataset: str, n: int) -> str:
    """The clean subset of ``dataset`` at ``n``, relative to the output folder."""
    return f"{CLEAN_DIR}/{clean_dir_name(dataset)}/n={n}.jsonl.gz"


def unchecked_ids(eval_rows: Iterable[EvalRow], min_eval_tokens: int) -> dict[str, set[str]]:
    """Per eval dataset, the ids of its rows decon never looked up: empty rows and rows of
    fewer than ``min_eval_tokens`` tokens (:func:`.index.short_rows`)."""
    rows = list(eval_rows)
    out: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        if r.empty:
            out[r.eval_dataset].add(r.instance_id)
    for r in short_rows(rows, min_eval_tokens):
        out[r.eval_dataset].add(r.instance_id)
    return out


def clean_ids(eval_rows: list[EvalRow], overlap_stats: list[dict[str, Any]], min_eval_tokens: int
              ) -> dict[tuple[str, int], set[str]]:
    """Per (eval dataset, n) of ``overlap_stats``: its clean instance ids (every id of the
    dataset but those overlapping at n and those with an unchecked row)."""
    unchecked = unchecked_ids(eval_rows, min_eval_tokens)
    ids: dict[str, set[str]] = defaultdict(set)
    for r in eval_rows:
        ids[r.eval_dataset].add(r.instance_id)
    return {(s["eval_dataset"], s["n"]): ids[s["eval_dataset"]] - set(s["instance_ids"]) - unchecked[s["eval_dataset"]]
            for s in overlap_stats}


def note_clean(overlap_stats: list[dict[str, Any]], eval_rows: list[EvalRow], min_eval_tokens: int) -> None:
    """Add the clean subsets' counts to each ``overlap_stats`` line, in place:
    ``num_clean_instances`` (ids), ``num_clean_rows`` (the lines of its :func:`clean_file`:
    more than the ids where rows share an id) and ``num_unchecked_instances`` (ids with an
    unchecked row, none of them overlapping at n). ValueError if the three do not add up to
    ``num_instances`` with the overlapping ids."""
    clean = clean_ids(eval_rows, overlap_stats, min_eval_tokens)
    unchecked = unchecked_ids(eval_rows, min_eval_tokens)
    ns_of: dict[str, list[int]] = defaultdict(list)
    for s in overlap_stats:
        ns_of[s["eval_dataset"]].append(s["n"])
    rows: dict[tuple[str, int], int] = defaultdict(int)
    for r in eval_rows:
        for n in ns_of[r.eval_dataset]:
            if r.instance_id in clean[(r.eval_dataset, n)]:
                rows[(r.eval_dataset, n)] += 1
    for s in overlap_stats:
        key = (s["eval_dataset"], s["n"])
        s["num_clean_instances"] = len(clean[key])
        s["num_clean_rows"] = rows[key]
        s["num_unchecked_instances"] = len(unchecked[s["eval_dataset"]] - set(s["instance_ids"]))
        if s["num_clean_instances"] + len(s["instance_ids"]) + s["num_unchecked_instances"] != s["num_instances"]:
            raise ValueError(f"{s['eval_dataset']} at n = {s['n']}: {s['num_clean_instances']} clean + "
                             f"{len(s['instance_ids'])} overlapping + {s['num_unchecked_instances']} unchecked "
                             f"instances are not its {s['num_instances']} instances")


def clean_line(record: dict[str, Any], row: EvalRow) -> bytes:
    """The line of a clean file for ``row``, read again as ``record``: the record as read (its
    keys in order), with ``"instance_id"`` added for a row without an id (``row.hashed_id``);
    a value JSON cannot hold (a Parquet timestamp or decimal) as its ``str()``. ValueError
    naming the row if such a row already has another ``"instance_id"``."""
    if row.hashed_id:
        have = record.get(ID_KEY)
        if have is not None and str(have) != row.instance_id:
            raise ValueError(f"{row.eval_path} row {row.eval_row}: has no id (its --id-field is missing or null) "
                             f"but a field {ID_KEY!r} ({have!r}) where its clean subset line would give its id "
                             f"{row.instance_id!r}; name that field with --id-field")
        record = {**record, ID_KEY: row.instance_id}
    return json.dumps(record, ensure_ascii=False, default=str).encode("utf-8", JSON_ERRORS) + b"\n"


def rows_as_read(rows: list[EvalRow], read_rows: Callable[[str], Iterable[Row]], id_field: str
                 ) -> Iterator[tuple[EvalRow, dict[str, Any]]]:
    """Each of ``rows`` (eval order) with its record read again by ``read_rows`` (path -> the
    rows of that file, as the index read them: :func:`~refinery.transforms.io.rows.iter_rows`),
    each file read once per run of its rows. ValueError naming the file and row where a
    record is not the one decon indexed (unreadable now, or another id) or the file ends first."""
    i = 0
    while i < len(rows):
        path = rows[i].eval_path
        j = i
        while j < len(rows) and rows[j].eval_path == path:
            j += 1
        wanted = iter(rows[i:j])
        want = next(wanted, None)
        for row, got, _error in read_rows(path):
            if want is None:
                break
            if row < want.eval_row:
                continue
            if row > want.eval_row:
                break
            now = None if got is None else record_id(got, id_field)
            if got is None or now != want.instance_id:
                raise ValueError(f"{path} row {row}: not the row decon indexed (id {want.instance_id!r}, now "
                                 f"{'unreadable' if now is None else f'id {now!r}'}); the eval file changed since: "
                                 f"run decon again")
            yield want, got
            want = next(wanted, None)
        if want is not None:
            raise ValueError(f"{path} row {want.eval_row}: not found again (the eval file changed since decon "
                             f"indexed it); run decon again")
        i = j


def write_clean_subsets(eval_rows: list[EvalRow], overlap_stats: list[dict[str, Any]], min_eval_tokens: int,
                        read_rows: Callable[[str], Iterable[Row]], id_field: str,
                        open_write: Callable[[str], ContextManager[storage.BinaryWriter]]
                        ) -> dict[tuple[str, int], int]:
    """Write every :func:`clean_file` of ``overlap_stats`` (after :func:`note_clean`), a dataset
    at a time (its n files open together, its eval files read once): ``open_write(relpath)``
    opens one for writing. Deterministic gzip (no name, mtime 0), so a rerun writes the same
    bytes. Returns the lines written per (dataset, n); ValueError if one differs from its
    line's ``num_clean_rows``."""
    clean = clean_ids(eval_rows, overlap_stats, min_eval_tokens)
    by_ds: dict[str, list[int]] = defaultdict(list)
    for s in overlap_stats:
        by_ds[s["eval_dataset"]].append(s["n"])
    rows_of: dict[str, list[EvalRow]] = defaultdict(list)
    for r in eval_rows:
        rows_of[r.eval_dataset].append(r)
    written: dict[tuple[str, int], int] = {}
    for ds, ns in by_ds.items():
        with contextlib.ExitStack() as stack:
            # GzipFile only writes to its fileobj (typeshed asks for flush too); no name, mtime 0: the same bytes again
            outs = {n: stack.enter_context(gzip.GzipFile(
                        filename="", mode="wb", compresslevel=6, mtime=0,
                        fileobj=cast("IO[bytes]", stack.enter_context(open_write(clean_file(ds, n))))))
                    for n in ns}
            sets = {n: clean[(ds, n)] for n in ns}
            counts = dict.fromkeys(ns, 0)
            for row, record in rows_as_read(rows_of.pop(ds, []), read_rows, id_field):
                at = [n for n in ns if row.instance_id in sets[n]]
                if at:
                    line = clean_line(record, row)
                    for n in at:
                        outs[n].write(line)
                        counts[n] += 1
        written.update(((ds, n), c) for n, c in counts.items())
    for s in overlap_stats:
        got = written[(s["eval_dataset"], s["n"])]
        if got != s.get("num_clean_rows", got):
            raise ValueError(f"{clean_file(s['eval_dataset'], s['n'])}: {got} rows written, "
                             f"{s['num_clean_rows']} clean rows counted")
    return written


def remove_stale_clean(output: str, current: set[str]) -> list[str]:
    """Remove the clean files under ``OUTPUT/stats/clean/`` that ``current`` (relative paths:
    this run's :func:`clean_file` s) does not name (another run's datasets or n), then their
    folders left empty. Only names decon writes there (``n=<n>.jsonl.gz``) are removed: another
    file is not decon's to delete. Returns the relative paths removed."""
    removed = []
    for folder in storage.listdir(storage.join(output, CLEAN_DIR)):
        if not storage.isdir(folder):
            continue
        for path in storage.listdir(folder):
            rel = f"{CLEAN_DIR}/{storage.basename(folder)}/{storage.basename(path)}"
            if CLEAN_NAME.fullmatch(storage.basename(path)) and rel not in current:
                storage.remove(path, root=output)
                removed.append(rel)
        if removed:
            storage.remove_empty_folder(folder, root=output)
    return removed


def unchanged_reader(fingerprints: list[dict[str, Any]], max_row_bytes: int) -> Callable[[str], Iterator[Row]]:
    """A ``read_rows`` for :func:`write_clean_subsets`: the rows of an eval file as the index
    read them (:func:`~refinery.transforms.io.rows.iter_rows`, the same row cap), after
    checking the file still has the size and version the index recorded
    (``fingerprints``: its input fingerprints); InputError naming the file if not."""
    recorded = {f["path"]: (f["size"], f["version"]) for f in fingerprints}

    def read(path: str) -> Iterator[Row]:
        now = [(f.size, f.version) for f in storage.expand_inputs([path])]
        if path not in recorded or now != [recorded[path]]:
            raise storage.InputError(f"{path}: changed since decon indexed it (recorded "
                                     f"{recorded.get(path)}, now {now}); run the same decon command again")
        return iter_rows(path, max_row_bytes=max_row_bytes)
    return read
