"""The eval side: eval rows, the n-gram index, its hash partitions and their serialization."""
from __future__ import annotations

import gzip
import io
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

import msgpack

from refinery.transforms.io.gc_pause import gc_paused
from refinery.transforms.io.jsonl import json_line
from refinery.transforms.io.rows import Row
from refinery.transforms.io.text import DEFAULT_MATCH_FOLD, TextSpec

from .compact import HashFind, RecordColumns, build_records, pack_records, unpack_records
from .hashes import batch_all_window_hashes, batch_prefix, tokenize_batch
from .ids import eval_dataset_name, field_dataset, record_id
from .membership import Membership
from .normalized import prepare, token_count, tokens_with_offsets
from .word_split import WordSplitter, effective_lengths, get_tokenizer


@dataclass(frozen=True)
class EvalRow:
    eval_idx: int          # global index over all eval files (sorted paths, then rows)
    eval_dataset: str
    eval_path: str
    eval_row: int          # 0-based row within eval_path
    instance_id: str
    text: str
    num_tokens: int
    empty: bool            # only empty tokens: contributes no n-gram
    hashed_id: bool = False  # the row had no id: ``instance_id`` is the hash of the record (:func:`.ids.record_id`)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass(frozen=True)
class SameText:
    """Eval rows with exactly the same text (their n-grams and offsets are the same):
    ``others[i]``: the later rows of the text whose first row (eval order) is ``i``;
    ``first[j]``: that first row, for each later row ``j``; ``datasets[i]``: the eval datasets
    of all the rows of that text, sorted. Rows with a text of their own are in none."""

    others: dict[int, list[int]]
    first: dict[int, int]
    datasets: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def first_of(self, eval_idx: int) -> int:
        """The first row (eval order) of the rows with ``eval_idx``'s text: the row that holds
        their shared state (records, overlaps, spans, samples)."""
        return self.first.get(eval_idx, eval_idx)

    def rows_of(self, first: int) -> list[int]:
        """The rows with the text of ``first`` (a first row), in eval order, ``first`` included."""
        return [first, *self.others.get(first, ())]


def same_text(eval_rows: list[EvalRow]) -> SameText:
    """The :class:`SameText` of ``eval_rows`` (empty rows included: they have no records)."""
    seen: dict[str, int] = {}
    others: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for r in eval_rows:
        i = seen.setdefault(r.text, r.eval_idx)
        if i != r.eval_idx:
            others.setdefault(i, []).append(r.eval_idx)
            first[r.eval_idx] = i
    datasets = {i: tuple(sorted({eval_rows[j].eval_dataset for j in (i, *rest)})) for i, rest in others.items()}
    return SameText(others, first, datasets)


def eval_rows_of(records: Iterable[tuple[str, str, int, dict[str, Any] | None]], text_field: str | TextSpec,
                 id_field: str, tokenizer: WordSplitter, bad: dict[str, dict[str, Any]] | None = None,
                 dataset_field: str | None = None, read_errors: Mapping[tuple[str, int], str] | None = None
                 ) -> tuple[list[EvalRow], dict[str, dict[str, Any]]]:
    """Eval rows of ``(dataset, path, row, record)`` in the given order + per-dataset counts of
    bad rows (a record that could not be read, None, or without text: a missing field, not a
    string); ``text_field``: a field name or a :class:`TextSpec` (a template, chat rows);
    ``bad``: counts to add to (datasets already named, with 0). ``text`` is the row's text
    as read; ``num_tokens`` and ``empty`` are of its normalized form (:mod:`.normalized`).

    ``dataset_field`` (``refinery decon --eval-dataset-field``): a row's dataset is that field's
    value (:func:`.ids.field_dataset`), not the ``dataset`` given with it; a row without a good
    one is a bad row of the given ``dataset`` (its file's). Then each dataset's counts also
    list its bad rows, ``"reasons": [[path, row, reason], ...]`` (the first
    :data:`LISTED_BAD_ROWS`; ``read_errors``: the reader's reason for an unread row)."""
    rows: list[EvalRow] = []
    bad = {} if bad is None else bad
    extract = TextSpec.of(text_field).extract
    for ds, path, row, record in records:
        reason = None
        if dataset_field is not None and record is not None:
            named, reason = field_dataset(record, dataset_field)
            ds = named or ds
        counts = bad.setdefault(ds, {"bad_rows": 0})
        text, why = extract(record)
        if reason is not None or text is None or record is None:  # a text only of a row (never of None)
            counts["bad_rows"] += 1
            if dataset_field is not None:
                listed = counts.setdefault("reasons", [])
                if len(listed) < LISTED_BAD_ROWS:
                    unread = record is None and (read_errors or {}).get((path, row))
                    listed.append([path, row, reason or unread or why or "unreadable"])
            continue
        num_tokens, empty = token_count(tokenizer, text)
        rows.append(EvalRow(len(rows), ds, path, row, record_id(record, id_field), text, num_tokens, empty,
                            record.get(id_field) is None))
    return rows, bad


LISTED_BAD_ROWS = 1000  # with --eval-dataset-field, the bad rows listed per dataset (all are counted)


def bad_row_reasons(bad: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The bad eval rows :func:`eval_rows_of` listed (with ``dataset_field``), in eval order:
    ``{"eval_path", "eval_row", "eval_dataset", "reason"}`` each (``stats/eval_bad_rows.jsonl``);
    ``eval_dataset``: the dataset it is counted in. Empty without ``dataset_field``."""
    out = [{"eval_path": path, "eval_row": row, "eval_dataset": ds, "reason": reason}
           for ds, counts in bad.items() for path, row, reason in counts.get("reasons", ())]
    return sorted(out, key=lambda r: (r["eval_path"], r["eval_row"]))


def bad_rows_warning(bad: Mapping[str, dict[str, Any]], shown: int = 5) -> str | None:
    """One line: how many eval rows were bad and the first ``shown`` with their reasons, or
    None when none is listed (:func:`bad_row_reasons`)."""
    listed = bad_row_reasons(bad)
    if not listed:
        return None
    count = sum(int(counts["bad_rows"]) for counts in bad.values() if "reasons" in counts)
    named = "; ".join(f"{r['eval_path']} row {r['eval_row']}: {r['reason']}" for r in listed[:shown])
    more = f" and {count - shown:,} more" if count > shown else ""
    return (f"{count:,} eval row(s) left out, counted as bad rows (listed in stats/eval_bad_rows.jsonl): "
            f"{named}{more}")


DEFAULT_MIN_EVAL_TOKENS = 5  # ``refinery decon --min-eval-tokens``: see docs/DECON.md


def short_rows(rows: list[EvalRow], min_tokens: int) -> list[EvalRow]:
    """The eval rows of fewer than ``min_tokens`` tokens (HELM tokens of the normalized text,
    :attr:`EvalRow.num_tokens`; empty rows aside: they have no n-gram anyway). ``refinery
    decon`` does not index them: the one n-gram of a row like "a", "the" or "1" is in most
    training rows."""
    return [r for r in rows if not r.empty and r.num_tokens < min_tokens]


def short_rows_warning(short: list[EvalRow], min_tokens: int, shown: int = 5) -> str | None:
    """One line naming the first ``shown`` of ``short`` (:func:`short_rows`), or None for none."""
    if not short:
        return None
    named = ", ".join(f"{r.eval_path} row {r.eval_row} (id {r.instance_id!r}, {r.num_tokens} token"
                      f"{'' if r.num_tokens == 1 else 's'})" for r in short[:shown])
    more = f" and {len(short) - shown:,} more" if len(short) > shown else ""
    return (f"{len(short):,} eval row(s) of fewer than {min_tokens} tokens are not indexed (--min-eval-tokens "
            f"{min_tokens}; their n-grams would flag most training rows): {named}{more}")


def note_short_rows(overlap_stats: list[dict[str, Any]], summary: list[dict[str, Any]], short: list[EvalRow]) -> None:
    """Add the short rows (:func:`short_rows`) to the run's stats, in place: each
    ``overlap_stats`` line gets ``num_short_instances`` and ``short_instance_ids`` (sorted) of
    its eval dataset, each ``eval_summary`` line ``num_short_rows``."""
    ids: dict[str, set[str]] = defaultdict(set)
    rows: dict[str, int] = defaultdict(int)
    for r in short:
        ids[r.eval_dataset].add(r.instance_id)
        rows[r.eval_dataset] += 1
    for s in overlap_stats:
        s["num_short_instances"] = len(ids[s["eval_dataset"]])
        s["short_instance_ids"] = sorted(ids[s["eval_dataset"]])
    for e in summary:
        e["num_short_rows"] = rows[e["eval_dataset"]]


def make_eval_rows(files: list[str], read_rows: Callable[[str], Iterable[Row]],
                   text_field: str | TextSpec, id_field: str, tokenizer: WordSplitter, dataset_field: str | None = None
                   ) -> tuple[list[EvalRow], dict[str, dict[str, Any]]]:
    """Eval rows of ``files`` (in the given order, each file's rows in order) + per-dataset
    counts of bad rows (:func:`eval_rows_of`). A row's dataset is its file's
    (:func:`.ids.eval_dataset_name`), or with ``dataset_field`` the one the row names (its
    file's only for a row that names none: no file's dataset is listed without a row)."""
    datasets = [(path, eval_dataset_name(path if "/" in path else os.path.abspath(path))) for path in files]
    if dataset_field is None:
        records = ((ds, path, row, record) for path, ds in datasets for row, record, _error in read_rows(path))
        return eval_rows_of(records, text_field, id_field, tokenizer, {ds: {"bad_rows": 0} for _, ds in datasets})
    errors: dict[tuple[str, int], str] = {}

    def read() -> Iterator[tuple[str, str, int, dict[str, Any] | None]]:
        for path, ds in datasets:
            for row, record, error in read_rows(path):
                if record is None and error is not None:
                    errors[(path, row)] = error
                yield ds, path, row, record

    return eval_rows_of(read(), text_field, id_field, tokenizer, {}, dataset_field, errors)


def build_index(rows: list[EvalRow], ns: Iterable[int], tokenizer: WordSplitter, skip: Collection[int] = ()
                ) -> dict[tuple[int, str], tuple[int, list[list[Any]]]]:
    """(effective length, n-gram) -> (ngram_hash, [[eval_idx, [[start, end], ...]], ...]) over
    the eval rows, in row order, but those whose ``eval_idx`` is in ``skip`` (``refinery
    decon`` skips the later rows of a text several rows have: :attr:`SameText.first`;
    their n-grams and offsets are the first row's). Hashes come from the vectorized twin
    (equal to :func:`ngram_hash`)."""
    index: dict[tuple[int, str], tuple[int, list[Any]]] = {}
    ns = list(ns)
    chunk = 4096
    if skip:
        rows = [r for r in rows if r.eval_idx not in skip]
    with gc_paused():
        for c in range(0, len(rows), chunk):
            part = rows[c:c + chunk]
            batch = tokenize_batch([prepare(tokenizer, r.text) for r in part], tokenizer.byte_table)
            prefix = batch_prefix(batch)
            window_hashes: dict[int, list[int]] = {}
            for k, r in enumerate(part):
                if r.empty:
                    continue
                tokens, spans = tokens_with_offsets(tokenizer, r.text)  # of the normalized text, into r.text
                first = int(batch.row_first[k])
                for length in effective_lengths(ns, len(tokens)):
                    if length not in window_hashes:
                        window_hashes[length] = batch_all_window_hashes(batch, prefix, length).tolist()
                    wh = window_hashes[length]
                    blank = " " * (length - 1)  # the n-gram of empty tokens only: skipped
                    seen: dict[str, list[Any]] = {}
                    for i, gram in enumerate([" ".join(tokens[i:i + length])
                                              for i in range(len(tokens) - length + 1)]):
                        offs = seen.get(gram)
                        if offs is None:
                            if gram == blank:
                                continue
                            offs = seen[gram] = []
                            key = (length, gram)
                            entry = index.get(key)
                            if entry is None:
                                entry = index[key] = (wh[first + i], [])
                            entry[1].append([r.eval_idx, offs])
                        offs.append([spans[i][0], spans[i + length - 1][1]])
    return index


def partition_records(index: Mapping[tuple[int, str], tuple[int, list[Any]]], partitions: int
                      ) -> dict[int, list[list[Any]]]:
    """Partition -> detail records ``[n, ngram, hash, [[eval_idx, [[s, e], ...]], ...]]``,
    ordered by hash (ties in index order: deterministic)."""
    out: dict[int, list[list[Any]]] = defaultdict(list)
    with gc_paused():
        for (length, gram), (h, evals) in index.items():
            out[h % partitions].append([length, gram, h, evals])
        for recs in out.values():
            recs.sort(key=itemgetter(2))
    return out


@dataclass
class NgramIndex:
    """THE test-side index, hash-partitioned: eval rows, the membership set the scan probes,
    and per hash partition the detail records that verify a hit and give its eval offsets.

    Built by :meth:`build` for both ``refinery decon`` (its ``index`` stage writes one file
    per part) and ``BuildNgramIndex`` (one element, a Beam side input).
    """

    rows: list[EvalRow]
    bad: dict[str, dict[str, Any]]               # eval dataset -> {"bad_rows": count}
    ns: list[int]
    tokenizer: str
    num_partitions: int
    membership: Membership
    records: Mapping[int, RecordColumns]     # partition -> [n, ngram, hash, [[eval_idx, offsets], ...]], by hash
    num_ngrams: int = 0
    match_fold: str = DEFAULT_MATCH_FOLD     # the tokenizer's match fold (both sides fold with it)

    @classmethod
    def build(cls, rows: list[EvalRow], bad: dict[str, dict[str, Any]], ns: Iterable[int], tokenizer: str,
              num_partitions: int, skip: Collection[int] = (), match_fold: str = DEFAULT_MATCH_FOLD) -> "NgramIndex":
        """The index of ``rows``; the records leave out the rows in ``skip``: those of
        :func:`build_index` and :func:`partition_records`, built in columns (:func:`.compact.build_records`:
        no Python object per n-gram, whatever the size of an eval row)."""
        ns = sorted(set(int(n) for n in ns))
        records, hashes, lengths = build_records(rows, ns, get_tokenizer(tokenizer, match_fold), num_partitions, skip)
        membership = Membership(hashes, lengths, {"tokenizer": tokenizer, "match_fold": match_fold,
                                                  "partitions": num_partitions, "ns": ns})
        return cls(rows, bad, ns, tokenizer, num_partitions, membership, records, len(hashes), match_fold)

    @property
    def splitter(self) -> WordSplitter:
        """The tokenizer the index was built with, and the scan must match with (its match fold)."""
        return get_tokenizer(self.tokenizer, self.match_fold)

    def lookup(self, p: int) -> Partition:
        """Partition ``p`` as :func:`load_partition` gives it (built on first use, then kept)."""
        cache: dict[int, Partition] = self.__dict__.setdefault("_parts", {})
        part = cache.get(p)
        if part is None:
            part = cache[p] = Partition(self.records.get(p) or RecordColumns.from_lists([]))
        return part

    def to_bytes(self) -> bytes:
        with gc_paused():
            data: bytes = msgpack.packb({
                "rows": [list(r.__dict__.values()) for r in self.rows], "bad": self.bad, "ns": self.ns,
                "tokenizer": self.tokenizer, "partitions": self.num_partitions,
                "membership": self.membership.to_bytes(),
                "records": {p: recs.to_lists() for p, recs in self.records.items()}, "num_ngrams": self.num_ngrams,
                "match_fold": self.match_fold,
            }, use_bin_type=True, unicode_errors="surrogatepass")
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> "NgramIndex":
        with gc_paused():
            d = msgpack.unpackb(data, raw=False, unicode_errors="surrogatepass", strict_map_key=False)
        return cls([EvalRow(*r) for r in d["rows"]], d["bad"], d["ns"], d["tokenizer"], d["partitions"],
                   Membership.from_bytes(d["membership"]),
                   {int(k): RecordColumns.from_lists(v) for k, v in d["records"].items()},
                   d["num_ngrams"], d["match_fold"])




def dumps_jsonl_gz(records: Iterable[dict[str, Any]]) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=6) as gz:
        for rec in records:
            gz.write(json_line(rec))
    return buf.getvalue()


def loads_jsonl_gz(data: bytes) -> Iterator[dict[str, Any]]:
    for line in gzip.decompress(data).splitlines():
        if line:
            yield json.loads(line)


class Partition:
    """One hash partition of the test index: its records ``[n, ngram, hash, [[eval_idx,
    [[start, end], ...]], ...]]`` ordered by hash (:class:`.compact.RecordColumns`: columns, a record
    read as a list), and the lookup the scan verifies hash hits against: ``(n, UTF-8 n-gram) ->
    record index`` (by hash, then text: no dict with a key per n-gram)."""

    def __init__(self, records: RecordColumns | list[list[Any]]):
        self.records = records if isinstance(records, RecordColumns) else RecordColumns.from_lists(records)
        self.find = HashFind(self.records)


def dumps_partition(records: RecordColumns | list[list[Any]]) -> bytes:
    """Partition detail records (:func:`partition_records`) -> msgpack bytes (of the lists)."""
    with gc_paused():
        return pack_records(records)


def load_partition(data: bytes) -> Partition:
    """Partition file bytes -> :class:`Partition` (read a record at a time, into columns)."""
    with gc_paused():
        return Partition(unpack_records(data))
