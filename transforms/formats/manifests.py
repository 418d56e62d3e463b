"""A prep output's ``manifest.json``: built from the shard units' receipts, serialized, verified.

The fields are documented in ``docs/FORMATS.md``: dataset, tokenizer, totals, the row
accounting (:func:`row_accounting`), per-shard sha256 under both ``sha256`` and ``checksum``
(the name nmoe's ``load_manifest`` reads), and ``created_at`` (kept across reruns of a plan:
:func:`keep_created_at`). :func:`verify_manifest` checks a manifest against its shards
(:func:`~.shards.check_shard`) and the run record beside it.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping

from refinery.transforms.formats.provenance import check_docs
from refinery.transforms.formats.shards import FORMAT_VERSION, IndexReader, check_shard, shard_files
from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID
from refinery.transforms.formats.tokenizer_choice import DEFAULT
from refinery.transforms.io import storage
from refinery.transforms.resumable.ledger import META_DIR, verify_receipts

if TYPE_CHECKING:
    from refinery.transforms.formats.tokenizer_choice import TokenizerSpec

MANIFEST = "manifest.json"



def entry_from_receipt(shard: int, receipt: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's entry for one shard, from the receipt of the unit that wrote it: its
    file records (path, bytes, sha256) of the ``.npy`` and ``.idx`` and its stats (tokens,
    docs). ``refinery prep``'s pack units and ``WriteTokenShards`` write the same receipts.
    With a provenance sidecar (``.docs.parquet``) in the receipt: ``docs_path`` and
    ``docs_sha256`` too (a receipt of before sidecars has none, and its entry none)."""
    by_ext = {f["path"].rsplit(".", 1)[1]: f for f in receipt["files"]}
    npy, idx, stats = by_ext["npy"], by_ext["idx"], receipt["stats"]
    entry = {"shard": shard, "path": npy["path"], "index_path": idx["path"],
             "num_tokens": int(stats["tokens"]), "num_documents": int(stats["docs"]),
             "sha256": npy["sha256"], "checksum": npy["sha256"], "index_sha256": idx["sha256"]}
    docs = by_ext.get("parquet")
    if docs is not None:
        entry.update({"docs_path": docs["path"], "docs_sha256": docs["sha256"]})
    return entry


def row_accounting(*, read: int, accepted: int, empty: int, rejected: int, written: int,
                   excluded: int | None = None, pieces: int | None = None) -> dict[str, Any]:
    """The manifest's ``rows``: ``read (+ pieces) = accepted + empty + rejected + over_budget (+
    excluded)``, where ``accepted`` counts the documents the shards hold (``written``),
    ``over_budget`` the accepted ones that ``--max-tokens`` left out, ``excluded`` (present
    when prep excluded overlaps) the rows a decon drop list named and ``pieces`` (present in
    span mode) the documents cut from those rows, counted in ``accepted`` too."""
    if read + (pieces or 0) != accepted + empty + rejected + (excluded or 0):
        raise ValueError(f"row counts do not add up: read {read}" + (f" + pieces {pieces}" if pieces is not None
                                                                     else "")
                         + f" != accepted {accepted} + empty {empty} + rejected {rejected}"
                         + (f" + excluded {excluded}" if excluded is not None else ""))
    return {"read": read, "accepted": written, "empty": empty, "rejected": rejected,
            "over_budget": accepted - written, **({"excluded": excluded} if excluded is not None else {}),
            **({"pieces": pieces} if pieces is not None else {})}


def build_manifest(*, dataset: str, entries: list[dict[str, Any]], rows: dict[str, Any], num_shards: int,
                   created_at: str, version: str = FORMAT_VERSION, extra: dict[str, Any] | None = None,
                   tokenizer: TokenizerSpec | None = None) -> dict[str, Any]:
    """THE manifest: what ``refinery prep`` and ``WriteTokenShards`` write as ``manifest.json``.

    Fields nmoe's ``load_manifest`` requires (dataset, version, tokenizer, vocab_size,
    eos_token_id, dtype, created_at, totals, num_shards, shards[] with path, index_path,
    num_tokens, num_documents, checksum) plus ours (vocab_sha256, rows, per-shard sha256 and
    index_sha256, and ``extra``: the run's plan). ``tokenizer``: a
    :class:`~refinery.transforms.formats.tokenizer_choice.TokenizerSpec` (default: o200k_harmony),
    whose :meth:`manifest_fields` give the tokenizer, vocab, EOS and dtype fields.
    """

    return {
        "dataset": dataset, "version": version, **(tokenizer or DEFAULT).manifest_fields(), "created_at": created_at,
        "total_tokens": sum(e["num_tokens"] for e in entries),
        "total_documents": sum(e["num_documents"] for e in entries),
        "num_shards": num_shards, **(extra or {}), "rows": rows, "shards": entries,
    }


CREATED_AT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # UTC, as keep_created_at records it


def recorded_time(raw: bytes) -> str | None:
    """The time a ``created_at`` file holds (ISO 8601, as :data:`CREATED_AT_FORMAT` writes it;
    surrounding whitespace allowed), or None when its bytes are anything else (not UTF-8, not
    a time)."""
    import datetime as dt

    try:
        text = raw.decode().strip()
        dt.datetime.fromisoformat(text)
    except ValueError:  # UnicodeDecodeError included
        return None
    return text


def keep_created_at(path: str) -> str:
    """The UTC time recorded in the file ``path``, or now (then recorded there): a plan's
    manifest keeps the ``created_at`` of its first run, so rewriting it gives the same bytes.
    A damaged file (not UTF-8, not such a time) is recorded again, with now, and a warning
    naming it: the time it held is lost, never read as garbage or a crash."""
    import datetime as dt
    import logging

    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raw = None
    if raw is not None and (kept := recorded_time(raw)) is not None:
        return kept
    now = dt.datetime.now(dt.timezone.utc).strftime(CREATED_AT_FORMAT)
    if raw is not None:
        logging.getLogger("refinery").warning(
            "%s: not a UTC time (%r): damaged; the manifest's created_at is now %s", path, raw[:40], now)
    storage.atomic_write_bytes(path, now.encode())
    return now


def manifest_json(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode()


def verify_manifest(manifest_path: str, checksums: bool = False, notes: list[str] | None = None) -> list[str]:
    """Every problem with a manifest and its shards ([] if none). Paths are named in each line;
    what is worth saying but not a problem (receipts of intermediate files removed) goes to
    ``notes``."""
    try:
        manifest = storage.read_json(manifest_path)
    except FileNotFoundError:
        return [f"{manifest_path}: missing"]
    except ValueError as e:
        return [f"{manifest_path}: not valid JSON ({e})"]
    root = storage.dirname(manifest_path)
    eos = int(manifest.get("eos_token_id", EOS_TOKEN_ID))
    problems: list[str] = []
    total_tokens = total_docs = 0
    for entry in manifest.get("shards", []):
        try:
            npy = storage.join(root, storage.safe_relpath(entry["path"]))
            idx = storage.join(root, storage.safe_relpath(entry["index_path"]))
        except ValueError as e:
            problems.append(f"{manifest_path}: {e}")
            continue
        problems += check_shard(npy, idx, eos, entry["num_tokens"], entry["num_documents"],
                                manifest.get("dtype", "uint32"))
        total_tokens += entry["num_tokens"]
        total_docs += entry["num_documents"]
        checked = [(npy, "sha256"), (idx, "index_sha256")]
        if "docs_path" in entry:  # the provenance sidecar (a manifest of before sidecars names none)
            try:
                docs = storage.join(root, storage.safe_relpath(entry["docs_path"]))
            except ValueError as e:
                problems.append(f"{manifest_path}: {e}")
            else:
                problems += _check_docs(docs, idx, entry["num_documents"])
                checked.append((docs, "docs_sha256"))
        if checksums:
            for path, key in checked:
                if storage.exists(path) and storage.sha256_file(path) != entry[key]:
                    problems.append(f"{path}: sha256 does not match the manifest")
        if "checksum" in entry and entry["checksum"] != entry.get("sha256"):
            problems.append(f"{manifest_path}: shard {entry['path']}: checksum and sha256 differ")
    if total_tokens != manifest.get("total_tokens") or total_docs != manifest.get("total_documents"):
        problems.append(f"{manifest_path}: totals ({manifest.get('total_tokens')} tokens, "
                        f"{manifest.get('total_documents')} docs) differ from the shards' sum "
                        f"({total_tokens}, {total_docs})")
    rows = manifest.get("rows", {})
    if manifest.get("total_documents") == 0:
        problems.append(f"{manifest_path}: 0 documents: the run accepted no rows ({rows.get('read', 0):,} read, "
                        f"{rows.get('rejected', 0):,} rejected; reasons in {storage.join(root, 'rejects')})")
    if rows and rows.get("read") != sum(rows.get(k, 0) for k in ("accepted", "empty", "rejected", "over_budget",
                                                                  "excluded")):
        problems.append(f"{manifest_path}: row accounting does not add up: {rows}")
    listed = {storage.join(root, e[k]) for e in manifest.get("shards", []) for k in ("path", "index_path", "docs_path")
              if k in e}
    for stray in shard_files(root):
        if stray not in listed:
            problems.append(f"{stray}: shard file not listed in the manifest")
    for tmp in storage.find_temp_files(root):
        problems.append(f"{tmp}: stray temporary file (an interrupted write)")
    problems += verify_run_record(root, manifest, checksums, notes)
    return problems


def _check_docs(docs: str, idx: str, num_documents: int) -> list[str]:
    """A sidecar's problems, its token counts compared with the ``.idx`` when that is readable."""

    try:
        lengths = IndexReader(idx).lengths()
    except (FileNotFoundError, ValueError):  # check_shard named it
        lengths = None
    return check_docs(docs, lengths, num_documents)


def verify_run_record(root: str, manifest: dict[str, Any], checksums: bool = False,
                      notes: list[str] | None = None) -> list[str]:
    """Problems with ``root/.refinery`` beside a manifest ([] if there is no run record,
    e.g. shards copied without it): every receipt of the recorded plan must verify, and the
    manifest must describe that plan (else the last run did not finish)."""

    run_json = storage.join(root, META_DIR, "run.json")
    try:
        info = storage.read_json(run_json)
    except FileNotFoundError:
        return []
    except ValueError as e:
        return [f"{run_json}: not valid JSON ({e})"]
    problems = verify_receipts(root, checksums, notes)
    last = (info.get("stages") or [{}])[-1]
    if "plan_hash" in manifest and last.get("name") == "manifest" and last.get("stage_hash") != manifest["plan_hash"]:
        problems.append(f"{storage.join(root, MANIFEST)}: describes plan {manifest['plan_hash']}, but the last run "
                        f"({run_json}) planned {last.get('stage_hash')}: that run has not finished")
    return problems
