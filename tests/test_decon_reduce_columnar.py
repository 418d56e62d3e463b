"""issue 47: decon's reduce as columns (:func:`ng.reduce_partition` in passes over a block's hits,
:class:`details.ParquetSink` / :class:`details.JsonLinesSink`) writes what the loop per hit
wrote before it, byte for byte: the Parquet parts, the JSON lines handed to ``write`` (each
call's bytes: the gzip member depends on the cuts) and the msgpack of the partition's results.
The loop per hit is kept here, unchanged but for its name, as the reference (no Beam)."""
from __future__ import annotations

import io
import json
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, chain
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import gsm8k_texts

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import details as dt
from refinery.transforms.decon.ngrams.details import NGRAM_MAX_CHARS
from refinery.transforms.decon.ngrams.droplist import RowHits
from refinery.transforms.decon.ngrams.index import EvalRow, SameText, same_text
from refinery.transforms.decon.ngrams.longest import record_windows
from refinery.transforms.decon.ngrams.reduce import SNIPPET_CONTEXT, SNIPPET_MAX_CHARS, overlap_key
from refinery.transforms.decon.ngrams.word_split import configured_ns
from refinery.transforms.io.jsonl import JSON_ERRORS
from refinery.transforms.io.positioned import PositionedWriter
from refinery.transforms.io.rows import Row

DEFAULT = ng.TOKENIZERS["default"]
# the reference's cuts, set with the module's (the ``small_cuts`` fixture makes them small)
WRITE_CHARS, WRITE_LINES, PREFIX_CACHE_EVALS, HELD_CHARS = dt.WRITE_CHARS, dt.WRITE_LINES, dt.PREFIX_CACHE_EVALS, \
    dt.HELD_CHARS


def _i64(data: bytes) -> list[int]:
    out: list[int] = np.frombuffer(data, dtype="<i8").tolist()
    return out


# -- the reference: the reduce and the Parquet rows before issue 47 -----------------------

def _pairs(offsets: list[Any]) -> str:
    """``[[1, 2], [3, 4]]`` as ``json.dumps`` writes it."""
    if len(offsets) == 1:
        (s, e), = offsets
        return f"[[{s}, {e}]]"
    return "[" + ", ".join(f"[{s}, {e}]" for s, e in offsets) + "]"




def _old_reduce_partition(records: Sequence[Sequence[Any]], eval_rows: list[EvalRow], ns: list[int],
                     blocks: Callable[[], Iterable[tuple[int, str, int, dict[str, Any]]]], max_train_count: int | None,
                     write: Callable[[bytes], None] | None, max_ngram_details: int | None = None,
                     same: SameText | None = None, rows_out: Any = None) -> dict[str, Any]:
    """The reduce as it was before issue 47 (a loop per hit), unchanged but for its name."""
    ns = sorted(set(ns))
    same = same_text(eval_rows) if same is None else same
    write = write if write is not None else print
    ignored = None
    if max_train_count is not None:
        seen = np.zeros(len(records), dtype=np.int64)
        for _, _, _, block in blocks():
            seen += np.bincount(np.frombuffer(block["record"], dtype="<i8"), minlength=len(records))
        ignored = (seen > max_train_count).tolist()
    counts = [0] * len(records)   # training documents holding each n-gram
    written = [0] * len(records)  # detail records written of each n-gram
    quote = json.encoder.encode_basestring  # a JSON string, non-ASCII and lone surrogates kept as they are
    heads: dict[int, str] = {}
    kept: dict[int, list[Any]] = {}                # record -> its [eval_idx, offsets], one per distinct text
    middles: dict[int, str] = {}              # record -> its detail lines' n-gram part
    prefixes: dict[int, list[str]] = {}       # record -> its detail lines up to the training part (few eval rows)
    sampled: dict[int, list[int]] = {}        # record -> eval rows it is an n-gram of, still sampling
    samples: dict[tuple[int, int], dict[tuple[int, int], list[Any]]] = {}  # (eval row, n-gram length) -> rows
    hit_rows: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # path -> record -> rows
    row_hits = RowHits()  # every counted hit's (training row, record): the drop list
    skip = None if ignored is None else np.asarray(ignored, dtype=bool)
    out: list[bytes] = []
    held = 0

    def head(eval_idx: int) -> str:
        h = heads.get(eval_idx)
        if h is None:
            er = eval_rows[eval_idx]
            h = heads[eval_idx] = (f'{{"eval_dataset": {quote(er.eval_dataset)}, "eval_path": '
                                   f'{quote(er.eval_path)}, "eval_row": {er.eval_row}, '
                                   f'"instance_id": {quote(er.instance_id)}')
            if eval_idx in same.others:
                h = heads[eval_idx] = f'{h}, "same_text": {len(same.others[eval_idx])}'
        return h

    def lines_of(rec: int, evals: list[Any]) -> list[str]:
        middle = middles[rec]
        return [f'{head(eval_idx)}, {middle}{_pairs(eval_offsets)}, ' for eval_idx, eval_offsets in evals]

    for unit, path, base, block in blocks():
        path_json = quote(path)
        recs, occ = _i64(block["record"]), _i64(block["occurrences"])
        starts, ends, snip = _i64(block["start"]), _i64(block["end"]), _i64(block["snippet_start"])
        rows, doc_ids, snippets = _i64(block["row"]), block["doc_id"], block["snippet"]
        recs_np = np.frombuffer(block["record"], dtype="<i8")
        row_hits.add(path, base, np.frombuffer(block["row"], dtype="<i8"), recs_np, doc_ids,
                     None if skip is None else ~skip[recs_np])
        o = 0
        rows_of_rec = hit_rows[path]
        for k, rec in enumerate(recs):
            a, o = o, o + occ[k]
            if ignored is not None and ignored[rec]:
                continue
            counts[rec] += 1
            row = base + rows[k]
            rows_of_rec[rec].append(row)
            evals = kept.get(rec)
            if evals is None:
                n, gram, _, evals = records[rec]
                if same.first:
                    evals = [e for e in evals if e[0] not in same.first]
                kept[rec] = evals
                if rows_out is None:  # JSON lines: the parts of a record's lines that do not change
                    cut = ', "ngram_truncated": true' if len(gram) > NGRAM_MAX_CHARS else ""
                    middles[rec] = f'"n": {n}, "ngram": {quote(gram[:NGRAM_MAX_CHARS])}{cut}, "eval_offsets": '
                    if len(evals) <= PREFIX_CACHE_EVALS:
                        prefixes[rec] = lines_of(rec, evals)
                sampled[rec] = [eval_idx for eval_idx, _ in evals]
            offs = list(zip(starts[a:o], ends[a:o]))
            room = len(evals) if max_ngram_details is None else min(len(evals), max_ngram_details - written[rec])
            if room > 0 and rows_out is not None:  # Parquet: columns, no JSON
                written[rec] += room
                gram = records[rec][1]
                rows_out.add(rec, records[rec][0], gram[:NGRAM_MAX_CHARS], len(gram) > NGRAM_MAX_CHARS, evals, room,
                             path, row, doc_ids[k], offs, snip[k], snippets[k],
                             offs[0][1] + SNIPPET_CONTEXT - snip[k] > SNIPPET_MAX_CHARS)
            elif room > 0:
                written[rec] += room
                cut = (', "train_snippet_truncated": true'
                       if offs[0][1] + SNIPPET_CONTEXT - snip[k] > SNIPPET_MAX_CHARS else "")
                tail = (f'"train_path": {path_json}, "train_row": {row}, "train_doc_id": {quote(doc_ids[k])}, '
                        f'"train_offsets": {_pairs(offs)}, "train_snippet_start": {snip[k]}, '
                        f'"train_snippet": {quote(snippets[k])}{cut}}}\n')
                cached = prefixes.get(rec)
                for c in range(0, room, WRITE_LINES):
                    lines = cached[c:room] if cached is not None else lines_of(rec, evals[c:min(room, c + WRITE_LINES)])
                    # encoded here, a few lines at a time: most are ASCII (a copy), where one
                    # non-ASCII character would make a whole joined chunk a slow encode
                    text = tail.join(lines) + tail
                    out.append(text.encode("utf-8", JSON_ERRORS))
                    held += len(text)
                    if held >= WRITE_CHARS:
                        write(b"".join(out))
                        out.clear()
                        held = 0
            if sampled[rec]:
                row_key = (unit, row)
                hit = [records[rec][2], offs, snip[k], snippets[k]]
                n = records[rec][0]
                for eval_idx in sampled[rec]:
                    rows_of = samples.setdefault((eval_idx, n), {})
                    if row_key in rows_of or len(rows_of) < 2:
                        rows_of.setdefault(row_key, [unit, row, path, []])[3].append(hit)
                # rows come in scan order: an eval row with two rows takes no later one from this record
                sampled[rec] = [eval_idx for eval_idx in sampled[rec] if len(samples[(eval_idx, n)]) < 2]
        if out:
            write(b"".join(out))
            out.clear()
            held = 0
    overlaps: dict[int, dict[int, dict[str, int]]] = {}
    spans: dict[int, dict[int, list[Any]]] = {}
    capped = []
    for rec, evals in kept.items():  # the first row of each text only: the others share its state
        n, gram = records[rec][0], records[rec][1]
        key = overlap_key(gram)
        for eval_idx, eval_offsets in evals:
            overlaps.setdefault(eval_idx, {}).setdefault(n, {})[key] = counts[rec]
            spans.setdefault(eval_idx, {}).setdefault(n, []).extend(eval_offsets)
        if counts[rec] * len(evals) > written[rec]:
            capped.append([n, gram[:NGRAM_MAX_CHARS], written[rec], counts[rec] * len(evals)])
    path_ids: dict[tuple[str, str, int], set[Any]] = defaultdict(set)
    path_rows: dict[tuple[str, str, int], set[Any]] = defaultdict(set)
    # record -> (eval_dataset, n) -> the first rows of the texts with rows of that dataset
    keys_of: dict[int, dict[tuple[str, int], list[int]]] = {}
    for path, rows_of_rec in hit_rows.items():
        for rec, rows in rows_of_rec.items():
            keys = keys_of.get(rec)
            if keys is None:
                keys = keys_of[rec] = {}
                n_rec = records[rec][0]
                for eval_idx, _ in kept[rec]:
                    er = eval_rows[eval_idx]
                    for ds in same.datasets.get(eval_idx, (er.eval_dataset,)):
                        for n in configured_ns(ns, er.num_tokens, n_rec):
                            keys.setdefault((ds, n), []).append(eval_idx)
            for (ds, n), ids in keys.items():
                path_ids[(path, ds, n)].update(ids)
                path_rows[(path, ds, n)].update(rows)
    return {"details": sum(written), "ignored": int(sum(ignored)) if ignored is not None else 0, "capped": capped,
            "overlaps": overlaps, "spans": spans,
            "by_path": [[*key, sorted(ids), sorted(path_rows[key])] for key, ids in sorted(path_ids.items())],
            "train_rows": row_hits.result(keys_of, len(eval_rows)),
            "windows": record_windows(records, kept),
            "samples": _by_row_and_length(samples)}


def _by_row_and_length(samples: dict[tuple[int, int], dict[tuple[int, int], list[Any]]]
                       ) -> dict[int, dict[int, list[Any]]]:
    """``{(eval row, length): {key: training row}}`` as ``{eval row: {length: [training rows]}}``."""
    out: dict[int, dict[int, list[Any]]] = {}
    for (eval_idx, n), rows_of in samples.items():
        out.setdefault(eval_idx, {})[n] = list(rows_of.values())
    return out




class _OldDetailRows:
    """A partition's detail records, written to ``out`` (a binary file) as Parquet.

    :meth:`add` takes one (training row, n-gram) hit and the first ``room`` of the n-gram's
    eval rows (``[eval_idx, eval offsets]``, one per distinct text): ``room`` rows, in that
    order. :meth:`close` writes what is held and the file's footer (a file with no rows has
    the schema and no row group)."""

    def __init__(self, out: Any, evals: dt.EvalColumns, row_group_rows: int = dt.ROW_GROUP_ROWS):
        self.evals = evals
        self.row_group_rows = row_group_rows
        self.writer = pq.ParquetWriter(pa.PythonFile(PositionedWriter(out), mode="w"), dt.SCHEMA,
                                       compression="zstd", compression_level=dt.COMPRESSION_LEVEL)
        self.cache: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        self.rows = 0  # written, all row groups
        self._clear()

    _HIT_COLUMNS = ("n", "ngram", "ngram_truncated", "train_path", "train_row", "train_doc_id", "train_pairs",
                    "train_flat", "train_snippet_start", "train_snippet", "train_snippet_truncated", "rows")

    def _clear(self) -> None:
        self._columns: tuple[list[Any], ...] = tuple([] for _ in self._HIT_COLUMNS)  # the hits' columns, in that order
        self.eval_idx: list[int] = []    # the eval side of the rows held, one entry per row
        self.eval_pairs: list[int] = []
        self.eval_flat: list[int] = []
        self.held_rows = self.held_chars = 0

    def _eval_side(self, key: int, evals: list[Any], a: int, b: int) -> tuple[list[int], list[int], list[int]]:
        """(eval_idx, pairs per row, flat offsets) of ``evals[a:b]``, as lists of ints (most
        records have one or two eval rows: numpy arrays per hit would cost more than they
        hold); cached by record ``key`` for a record with few eval rows (it comes back with
        each training row)."""
        got = self.cache.get(key) if len(evals) <= dt.CACHE_EVALS else None
        if got is None:
            lo, hi = (0, len(evals)) if len(evals) <= dt.CACHE_EVALS else (a, b)
            part = evals[lo:hi]
            pairs = [len(e[1]) for e in part]
            got = ([e[0] for e in part], pairs, [x for e in part for pair in e[1] for x in pair],
                   list(accumulate(pairs, initial=0)))
            if len(evals) <= dt.CACHE_EVALS:
                self.cache[key] = got
            else:
                a, b = 0, b - a
        idx, pairs, flat, starts = got
        if a == 0 and b == len(idx):  # the common case: all of a record's eval rows
            return idx, pairs, flat
        return idx[a:b], pairs[a:b], flat[2 * starts[a]:2 * starts[b]]

    def add(self, key: int, n: int, ngram: str, ngram_truncated: bool, evals: list[Any], room: int, train_path: str,
            train_row: int, train_doc_id: str, train_offsets: list[Any], snippet_start: int, snippet: str,
            snippet_truncated: bool) -> None:
        """``room`` rows: the hit of record ``key`` (its ``n``, ``ngram`` as written) in a
        training row, for each of ``evals[:room]``. A row group holds at most
        :data:`HELD_CHARS` characters of the hit's strings, repeated on each of its rows (a
        row with a huge snippet alone may be more)."""
        per_row = len(ngram) + len(train_doc_id) + len(snippet) + 1
        step = max(1, min(self.row_group_rows, HELD_CHARS // per_row))
        for a in range(0, room, step):
            b = min(room, a + step)
            idx, pairs, flat = self._eval_side(key, evals, a, b)
            (n_, ngram_, ngram_truncated_, path_, row_, doc_id_, pairs_, flat_, snippet_start_, snippet_,
             snippet_truncated_, rows_) = self._columns  # one hit per call: its columns' lists, bound once
            n_.append(n)
            ngram_.append(ngram)
            ngram_truncated_.append(ngram_truncated)
            path_.append(train_path)
            row_.append(train_row)
            doc_id_.append(train_doc_id)
            pairs_.append(len(train_offsets))
            flat_.extend(chain.from_iterable(train_offsets))
            snippet_start_.append(snippet_start)
            snippet_.append(snippet)
            snippet_truncated_.append(snippet_truncated)
            rows_.append(b - a)
            self.eval_idx.extend(idx)
            self.eval_pairs.extend(pairs)
            self.eval_flat.extend(flat)
            self.held_rows += b - a
            self.held_chars += (b - a) * per_row
            if self.held_rows >= self.row_group_rows or self.held_chars >= HELD_CHARS:
                self.flush()

    def flush(self) -> None:
        """Write the rows held as one row group."""
        if not self.held_rows:
            return
        h = dict(zip(self._HIT_COLUMNS, self._columns))
        rep = pa.array(np.repeat(np.arange(len(h["rows"]), dtype=np.int64), h["rows"]))
        hit_cols = {
            "n": pa.array(h["n"], pa.int32()), "ngram": dt.strings(h["ngram"]),
            "ngram_truncated": pa.array(h["ngram_truncated"], pa.bool_()),
            "train_path": dt._names(h["train_path"]), "train_row": pa.array(h["train_row"], pa.int64()),
            "train_doc_id": dt.strings(h["train_doc_id"]),
            "train_offsets": dt.pairs_array(np.asarray(h["train_pairs"], dtype=np.int64),
                                         np.asarray(h["train_flat"], dtype=np.int64)),
            "train_snippet_start": pa.array(h["train_snippet_start"], pa.int64()),
            "train_snippet": dt.strings(h["train_snippet"]),
            "train_snippet_truncated": pa.array(h["train_snippet_truncated"], pa.bool_()),
        }
        eval_cols = dict(zip(("eval_dataset", "eval_path", "eval_row", "instance_id", "same_text"),
                             self.evals.take(np.asarray(self.eval_idx, dtype=np.int64))))
        eval_cols["eval_offsets"] = dt.pairs_array(np.asarray(self.eval_pairs, dtype=np.int64),
                                                np.asarray(self.eval_flat, dtype=np.int64))
        columns = [eval_cols[f.name] if f.name in eval_cols else hit_cols[f.name].take(rep) for f in dt.SCHEMA]
        self.writer.write_table(pa.Table.from_arrays(columns, schema=dt.SCHEMA), row_group_size=self.held_rows)
        self.rows += self.held_rows
        self._clear()

    def close(self) -> None:
        self.flush()
        self.writer.close()




# -- the corpora ------------------------------------------------------------------------

def eval_rows_of(texts: list[str], datasets: int = 1) -> list[EvalRow]:
    def read(path: str) -> Iterator[Row]:
        for i, t in enumerate(texts):
            if i % datasets == int(path.split("/")[1][2:]):
                yield i, {"text": t, "id": f"e{i % 7}" if i % 5 == 3 else f"e{i}"}, None
    rows, _ = ng.make_eval_rows([f"x/ds{d}/test.jsonl" for d in range(datasets)], read, "text", "id", DEFAULT)
    return rows


def blocks_of(rows: list[EvalRow], train: list[str], ns: list[int], partitions: int,
              max_chars: int = 1 << 20) -> tuple[ng.NgramIndex, dict[int, list[tuple[int, str, int, dict[str, Any]]]]]:
    """Per partition: its records and its hit blocks (through msgpack, as on disk), from two scan units."""
    index = ng.NgramIndex.build(rows, {}, ns, "default", partitions)
    blocks: dict[int, list[tuple[int, str, int, dict[str, Any]]]] = defaultdict(list)
    half = len(train) // 2
    for unit, (path, part) in enumerate((("t/a.jsonl", train[:half]), ("t/b\u00e9.jsonl", train[half:]))):
        docs = ((j, {"text": t, "id": f"d{j % 11}\udc80" if j % 13 == 4 else f"d{j}"}, None)
                for j, t in enumerate(part))
        for hits in ng.scan_rows(docs, text_field="text", tokenizer=DEFAULT, membership=index.membership,
                                 lookup=index.lookup, partitions=partitions, stats=ng.ScanStats()):
            for piece in ng.split_hits(hits, max_chars):
                for p, block in ng.hit_blocks([ng.hit_groups(piece, "id")]):
                    packed = msgpack.packb(block, use_bin_type=True, unicode_errors="surrogatepass")
                    blocks[p].append((unit, path, 5 * unit, msgpack.unpackb(packed, raw=False,
                                                                            unicode_errors="surrogatepass")))
    return index, blocks


def both(rows: list[EvalRow], index: ng.NgramIndex, blocks: dict[int, list[tuple[int, str, int, dict[str, Any]]]],
         ns: list[int], max_train_count: int | None = None, max_ngram_details: int | None = None,
         row_group_rows: int = dt.ROW_GROUP_ROWS) -> int:
    """Every partition reduced by both, in both formats: the same bytes; the details written."""
    same = same_text(rows)
    columns = dt.EvalColumns.of(rows, same)
    details = 0
    for p in range(index.num_partitions):
        records: Sequence[Sequence[Any]] = index.records.get(p) or []
        got = []

        def part_blocks(p: int = p) -> Any:
            return iter(blocks[p])

        reducers: list[tuple[Callable[..., Any], Any]] = [(_old_reduce_partition, _OldDetailRows),
                                                          (ng.reduce_partition, dt.DetailRows)]
        for reduce, detail_rows in reducers:
            writes: list[bytes] = []
            res = reduce(records, rows, ns, part_blocks, max_train_count, writes.append, max_ngram_details, same)
            buf = io.BytesIO()
            out = detail_rows(buf, columns, row_group_rows)
            res2 = reduce(records, rows, ns, part_blocks, max_train_count, None, max_ngram_details, same, rows_out=out)
            out.close()
            assert out.rows == res2["details"] == res["details"]
            for r in (res, res2):  # the spans span mode cuts: new since the old reduce (test_exclude_spans);
                r["train_rows"].pop("spans", None)  # the ignored n-grams' instances (test_decon_ignored_only)
                r.pop("ignored_evals", None)
            got.append((writes, buf.getvalue(), msgpack.packb(res, use_bin_type=True, unicode_errors="surrogatepass"),
                        msgpack.packb(res2, use_bin_type=True, unicode_errors="surrogatepass")))
        (w0, pq0, r0, s0), (w1, pq1, r1, s1) = got
        assert [len(w) for w in w1] == [len(w) for w in w0], p  # the same cuts
        assert w1 == w0, p
        assert pq1 == pq0, p
        assert r1 == r0 == s0 == s1, p
        details += msgpack.unpackb(r0, strict_map_key=False, unicode_errors="surrogatepass")["details"]
    return details


@pytest.fixture
def small_cuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON lines handed over every ~2 kB, heads cached for records of up to 3 eval rows, lines
    built 4 at a time, Parquet groups of 3 kB of strings: every cut of the code is reached."""
    for name, value in (("WRITE_CHARS", 2000), ("WRITE_LINES", 4), ("PREFIX_CACHE_EVALS", 3), ("HELD_CHARS", 3000)):
        monkeypatch.setattr(dt, name, value)
        monkeypatch.setitem(globals(), name, value)


def test_sparse_and_dense_corpora_give_the_same_bytes() -> None:
    evals = gsm8k_texts(20)
    sparse = [t + (f" see {evals[i % 20]}" if i % 9 == 0 else "") for i, t in enumerate(gsm8k_texts(40, 100))]
    rows = eval_rows_of(evals, datasets=2)
    index, blocks = blocks_of(rows, sparse, [5, 9, 13], 4)
    assert both(rows, index, blocks, [5, 9, 13]) > 0
    index, blocks = blocks_of(rows, evals * 2, [5, 13], 3)   # dense: the eval set itself, twice
    assert both(rows, index, blocks, [5, 13]) > 500


def test_hostile_corpora_give_the_same_bytes(small_cuts: None) -> None:
    common = "the quick brown fox jumps over the lazy dog while the cat sleeps"
    long_token = "x" * 1500  # an n-gram and a snippet past their caps
    texts = ([f"{common} row{i} \u00e9t\u00e9" for i in range(30)] + [common + " and dreams"] * 6
             + [f"{long_token} a b c d e f g h i j k l m", "caf\u00e9 \ud800 broken text here today now"])
    rows = eval_rows_of(texts)
    train = [f"doc {j}: {texts[j % len(texts)]} {common}" for j in range(40)] + [texts[-2], texts[-1]] * 2
    index, blocks = blocks_of(rows, train, [5, 13], 2, max_chars=3000)
    got = [both(rows, index, blocks, [5, 13], row_group_rows=200, **kwargs)
           for kwargs in ({}, {"max_ngram_details": 7}, {"max_ngram_details": 45}, {"max_train_count": 3})]
    assert got[0] > got[2] > got[1] > 0 and got[3] > 0  # the caps cut


@pytest.mark.parametrize("seed", range(6))
def test_random_corpora_with_planted_overlaps(seed: int, small_cuts: None) -> None:
    """Random eval sets and corpora, overlaps planted at a random n: the columns give what the
    loop gave, every partition, both formats."""
    rnd = random.Random(seed)
    vocab = [f"w{k}" for k in range(rnd.choice([8, 40, 400]))] + ["\u00fcber", "na\u00efve", "\u4e2d"]
    evals = [" ".join(rnd.choices(vocab, k=rnd.randint(1, 30))) for _ in range(rnd.randint(5, 40))]
    evals += rnd.sample(evals, min(3, len(evals)))  # some rows share a text
    train = []
    for _ in range(rnd.randint(10, 60)):
        words = rnd.choices(vocab, k=rnd.randint(0, 40))
        if rnd.random() < 0.6:
            src = rnd.choice(evals).split()
            n = rnd.randint(1, len(src))
            at = rnd.randint(0, len(src) - n)
            words[rnd.randint(0, len(words)):0] = src[at:at + n]
        train.append(" ".join(words))
    ns = sorted(rnd.sample([2, 3, 5, 8, 13], rnd.randint(1, 3)))
    rows = eval_rows_of(evals, datasets=rnd.choice([1, 2]))
    index, blocks = blocks_of(rows, train, ns, rnd.choice([1, 3, 8]), max_chars=rnd.choice([200, 1 << 20]))
    cap = rnd.choice([None, 1, 5, 50])
    limit = rnd.choice([None, 2, 10])
    both(rows, index, blocks, ns, max_train_count=limit, max_ngram_details=cap, row_group_rows=rnd.choice([7, 64]))
