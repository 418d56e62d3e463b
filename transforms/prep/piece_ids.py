"""Span mode: no piece's id is a real row's, checked across a whole run in bounded memory.

A piece of a listed row is named ``ROW_ID@START`` (:func:`~.span_cut.piece_id`). A real row's
id is any string (``str()`` of its ``--id-field``, which JSON lets hold anything), so no
spelling of a piece's id is one a real id cannot have: a row whose id is ``r0@0`` and the
first piece of the row ``r0`` would be two documents with one id. So each unit that writes
pieces (prep's tokenize units, clean's units) lists, in a part of its own, every piece's id
and every id of a row it keeps that has a piece's form (:func:`has_piece_form`: ``@`` and
a start, in its canonical decimal, at its end: rare in real ids), each as one
:func:`id_line`; the run's last stage (prep's manifest, clean's manifest) compares the two
lists (:func:`check_piece_ids`) and fails, naming both rows, on an id in both: no shard,
copy or manifest is finished with two documents of one id. Memory holds the shorter list
(usually the ids of a piece's form: none), never the corpus's ids.

Rows that share an id in the input (two rows with id ``x``) are the input's: neither prep
nor clean checks real ids against each other.
"""
from __future__ import annotations

import json
import re
from typing import Iterable, Iterator, NamedTuple

from refinery.transforms.io import storage

_PIECE_FORM = re.compile(r"@(?:0|[1-9][0-9]*)\Z")  # what piece_id(row_id, start) ends with


class IdAt(NamedTuple):
    """A document id and the row it is of: the file (as read) and its 0-based row there."""

    doc_id: str
    path: str
    row: int


def has_piece_form(doc_id: str) -> bool:
    """Whether ``doc_id`` could be a piece's id: it ends in ``@`` and a start (ASCII digits,
    no leading zero: what ``piece_id`` writes)."""
    return "@" in doc_id and _PIECE_FORM.search(doc_id) is not None


def id_line(doc_id: str, path: str, row: int) -> bytes:
    """The line a piece-id list holds for one document: ``[id, path, row]``."""
    return json.dumps([doc_id, path, row], ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"


def read_ids(paths: Iterable[str]) -> Iterator[IdAt]:
    """The :func:`id_line` lines of the files ``paths``, in order, a line at a time."""
    for path in paths:
        with storage.open_read(path) as f:
            for line in f:
                doc_id, source, row = json.loads(line.decode("utf-8", "surrogatepass"))
                yield IdAt(str(doc_id), str(source), int(row))


def first_shared(held: Iterable[IdAt], streamed: Iterable[IdAt]) -> tuple[IdAt, IdAt] | None:
    """The first id of ``streamed`` that ``held`` has too, as (held's, streamed's), or None;
    only ``held`` is kept in memory."""
    index: dict[str, IdAt] = {}
    for item in held:
        index.setdefault(item.doc_id, item)
    for item in streamed:
        other = index.get(item.doc_id)
        if other is not None:
            return other, item
    return None


def check_piece_ids(pieces: list[str], piece_count: int, formed: list[str], formed_count: int) -> None:
    """:class:`RuntimeError` naming both rows when a piece's id (the lists ``pieces``, holding
    ``piece_count`` ids) is the id of a row kept as it is (the lists ``formed``: the kept rows'
    ids of a piece's form, ``formed_count`` of them); the shorter side is the one held."""
    if not piece_count or not formed_count:
        return
    if formed_count <= piece_count:
        shared = first_shared(read_ids(formed), read_ids(pieces))
        pair = None if shared is None else (shared[1], shared[0])
    else:
        pair = first_shared(read_ids(pieces), read_ids(formed))
    if pair is None:
        return
    piece, row = pair
    start = piece.doc_id.rsplit("@", 1)[1]
    raise RuntimeError(f"document id {piece.doc_id!r} is both the piece of {piece.path} row {piece.row} that starts "
                       f"at character {start} and the id of {row.path} row {row.row}: two documents would have one id "
                       "(span mode names a piece ROW_ID@START); give that row another id (or name the rows by "
                       "another --id-field), then run the same command again")
