"""The documents an inference command reads (``refinery generate``, HYDRA's oracle labels
and grades): rows of JSONL/JSON/parquet files (``--text-field``, ``--id-field``; a missing id
becomes ``{relpath}:{row}``), or doc ids (``{source}//{relpath}#s=..:e=..``) listed in files
and read from prep shards under a data root (:class:`DocumentSource`); an infer unit is a
slice of at most ``docs_per_unit`` documents of one input file (:class:`InferPayload`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from refinery.transforms.formats.docids import read_doc_tokens, read_docid_file
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.inference.handler import decode
from refinery.transforms.io import rows, storage
from refinery.transforms.resumable import Unit

JsonObject = dict[str, Any]
"""A JSON object: an example for the handler, a document's metadata, an output row."""


class InferPayload(TypedDict):
    """An infer unit: documents ``[lo, hi)`` of input file number ``file``."""

    file: int
    path: str
    relpath: str
    lo: int
    hi: int


@dataclass
class Doc:
    """One input document: ``id``, and ``text`` or ``tokens`` (doc-id inputs), or an ``error``."""

    id: str
    text: str | None = None
    tokens: list[int] | None = None
    error: str | None = None
    where: str = ""  # file:row, for messages

    def get_tokens(self) -> list[int]:
        if self.tokens is None:
            self.tokens = get_encoding().encode_ordinary(self.text or "")
        return self.tokens

    def get_text(self) -> str:
        if self.text is None:
            self.text = decode(self.tokens or [])
        return self.text


@dataclass
class DocumentSource:
    """Where documents come from: data files (``paths``) or doc-id files + ``data_root``."""

    paths: list[str] = field(default_factory=list)
    docid_files: list[str] = field(default_factory=list)
    data_root: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    docs_per_unit: int = 256

    def __post_init__(self) -> None:
        if bool(self.paths) == bool(self.docid_files):
            raise ValueError("give either input data files or doc-id files (with a data root), not both")
        if self.docid_files and not self.data_root:
            raise ValueError("doc-id inputs need --data-root (the folder their relpaths start from)")
        if self.docs_per_unit < 1:
            raise ValueError("docs per unit must be at least 1")
        # doc-id files may have any name (docids_val.jsonl, val_shard_00, ...)
        self.skipped: list[str] = []  # files of the input folders skipped for their extension
        self.files = (storage.expand_inputs(self.paths, skipped=self.skipped) if self.paths
                      else storage.expand_inputs(self.docid_files, suffixes=("",)))
        self._plan: list[Unit[InferPayload]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: configuration, not the input list or the plan (a worker reads its
        units from the plan the driver wrote, ``Stage.plan_ref``, and the inputs' fingerprints
        from the output, ``StageRun.input_fingerprints``), so that the job does not grow with them."""
        state = dict(self.__dict__)
        state.pop("files", None)
        state["skipped"], state["_plan"] = [], None
        return state

    def config(self) -> JsonObject:
        return {"kind": "docids" if self.docid_files else "rows", "text_field": self.text_field,
                "id_field": self.id_field, "docs_per_unit": self.docs_per_unit}

    def fingerprints(self) -> list[JsonObject]:
        fps = [f.fingerprint() for f in self.files]
        if self.data_root:
            fps += [f.fingerprint() for f in storage.expand_inputs([self.data_root], suffixes=(".npy",))]
        return fps

    def _count(self, path: str) -> int:
        if self.docid_files:
            return sum(1 for _ in read_docid_file(path))
        return sum(1 for _ in rows.iter_rows(path))

    def plan(self) -> list[Unit[InferPayload]]:
        """Units: ``fNNNNN-dNNNNNNNN`` = documents ``[lo, hi)`` of file NNNNN (document order)."""
        if self._plan is None:
            units: list[Unit[InferPayload]] = []
            for fi, f in enumerate(self.files):
                n = self._count(f.path)
                for lo in range(0, n, self.docs_per_unit):
                    units.append(Unit(f"f{fi:05d}-d{lo:08d}", InferPayload(
                        file=fi, path=f.path, relpath=f.relpath, lo=lo, hi=min(n, lo + self.docs_per_unit))))
            self._plan = units
        return self._plan

    def read(self, payload: InferPayload) -> list[Doc]:
        """The documents of one unit, in order."""
        lo, hi, path = payload["lo"], payload["hi"], payload["path"]
        docs: list[Doc] = []
        if self.docid_files:
            data_root = self.data_root
            assert data_root is not None  # __post_init__: doc-id inputs come with a data root
            for i, (line, doc_id) in enumerate(read_docid_file(path)):
                if lo <= i < hi:
                    where = f"{path}:{line}"
                    try:
                        docs.append(Doc(doc_id, tokens=read_doc_tokens(data_root, doc_id), where=where))
                    except (ValueError, FileNotFoundError) as e:
                        docs.append(Doc(doc_id, error=str(e), where=where))
            return docs
        for i, (row, record, error) in enumerate(rows.iter_rows(path)):
            if not lo <= i < hi:
                continue
            where = f"{path}:{row + 1}"
            if error is not None:
                docs.append(Doc(f"{payload['relpath']}:{row}", error=f"{where}: {error}", where=where))
                continue
            assert record is not None  # iter_rows: a record, or else an error
            rid = record.get(self.id_field)
            doc_id = str(rid) if rid is not None else f"{payload['relpath']}:{row}"
            text = record.get(self.text_field)
            if not isinstance(text, str):
                docs.append(Doc(doc_id, error=f"{where}: text field {self.text_field!r} missing or not a string",
                                where=where))
            else:
                docs.append(Doc(doc_id, text=text, where=where))
        return docs
