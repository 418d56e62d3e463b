"""Where prep's tokenize and pack stages spend their time, part by part, against the encoder alone.

``bench/prep.py --breakdown`` (and ``--parts-only``) calls :func:`measure_round` once per
round, in one process with one worker's encoder (built once, its cache warm), on the corpus
folder of the layout:

- each **part** of the tokenize and pack units as a pass of its own over the same input,
  calling the functions the units call, a tokenize unit of the plan at a time (bounded
  memory): read and decompress, JSON parse, text build (the text field or template),
  normalize, ids and shards (md5), encode (this process's first pass over the texts: the
  encoder's cache cold, as in a prep run), spill write, sha256 of the spills (every byte the
  unit's atomic writers hash), pack read, pack write (the ``.npy`` and ``.idx``), sidecar
  (``.docs.parquet``, the names read back included), sha256 of the shard's files;
- the **encoder alone** on the documents' normalized texts, already in memory, in prep's
  batches: the ceiling (``encode_documents``: tokens, EOS put in, one uint32 buffer; a
  second pass, its cache warm);
- the **stages** as they run (after both passes: the encoder's cache warm): every tokenize
  unit of the plan, then every pack unit, in this process (no Beam around them), their
  atomic writes (sha256, fsync) and receipts included.

Every figure is CPU seconds of the process (``time.process_time``: steadier than wall time on
a shared machine, and what a corpus costs in core-hours), but for the stages' wall seconds,
printed below them (which count fsync's waits). "rest" is a stage's CPU time less its parts':
what the parts' sum leaves out (the atomic writes' renames, receipts, the interplay of the
parts). ``--before REV`` runs the
same rounds with the code of git revision REV (its own copy of this file), alternating with
this checkout's, one fresh process a round each (``--json``).
"""
from __future__ import annotations

import gc
import hashlib
import io
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from refinery.transforms.formats import provenance, shards
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.io import storage
from refinery.transforms.io.rows import line_blocks, open_lines, parse_json_lines, plain_json_lines, row_lines
from refinery.transforms.io.text import normalize_text
from refinery.transforms.prep import pack, spill
from refinery.transforms.prep.documents import (
    BATCH_CHARS,
    BATCH_DOCS,
    encode_by_shard,
    encode_documents,
    extract_text,
    shards_of,
)
from refinery.transforms.prep.stages import PrepConfig, build_stages
from refinery.transforms.resumable import bind_stages, execute_unit

TOKENIZE_PARTS = ("read and decompress", "JSON parse", "text build", "normalize", "ids and shards (md5)",
                  "encode (a first pass)", "spill write", "sha256 (spills)")
PACK_PARTS = ("pack read", "pack write (.npy, .idx)", "sidecar (.docs.parquet)", "sha256 (shards)")


class Clock:
    """Seconds per part, summed over calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, part: str, fn: Callable[[], Any]) -> Any:
        t0 = time.process_time()
        out = fn()
        self.seconds[part] = self.seconds.get(part, 0.0) + time.process_time() - t0
        return out


def _batches(n: int, chars: Callable[[int], int]) -> Iterator[tuple[int, int]]:
    """[lo, hi) of prep's batches over ``n`` documents (:data:`BATCH_CHARS`, :data:`BATCH_DOCS`)."""
    lo, size = 0, 0
    for i in range(n):
        size += chars(i)
        if size >= BATCH_CHARS or i + 1 - lo >= BATCH_DOCS:
            yield lo, i + 1
            lo, size = i + 1, 0
    if lo < n:
        yield lo, n


def _read(path: str, cap: int) -> list[list[bytes | None]]:
    with open_lines(path, compression="infer") as f:
        return [part.rows for part in row_lines(line_blocks(f, cap))]


def _parse(blocks: list[list[bytes | None]], cap: int) -> list[tuple[list[bytes | None], list[Any], list[Any]]]:
    return [(lines, *parse_json_lines(lines, cap)) for lines in blocks]


def _texts(parsed: list[tuple[list[bytes | None], list[Any], list[Any]]], cfg: PrepConfig
           ) -> list[tuple[int, dict[str, Any], str, bool]]:
    """(row, record, text, plain) of the rows with a text: a plain line's text field, else extract_text's."""
    spec, field, out, row = cfg.text, cfg.text.field, [], 0
    for lines, records, errors in parsed:
        for record, error, plain in zip(records, errors, plain_json_lines(lines)):
            if plain and type(record) is dict and type(text := record.get(field)) is str:
                out.append((row, record, text, True))
            elif error is None:
                text, _ = extract_text(record, spec)
                if text is not None:
                    out.append((row, record, text, False))
            row += 1
    return out


def _ids(docs: list[tuple[int, dict[str, Any], str, bool]], cfg: PrepConfig, relpath: str
         ) -> tuple[list[str], np.ndarray]:
    ids = [doc_id_for(record, cfg.id_field, relpath, row) for row, record, _, _ in docs]
    return ids, shards_of(ids, cfg.num_shards)


def tokenize_parts(cfg: PrepConfig, enc: Any, clock: Clock, spill_dir: Path) -> list[list[str]]:
    """Each tokenize part over every unit of the plan; the normalized texts (by unit) back."""
    out: list[list[str]] = []
    for unit_no, unit in enumerate(build_stages(cfg)[0].plan()):
        unit_texts: list[str] = []
        spill_path = spill_dir / f"{unit_no}.spill"
        with open(spill_path, "wb") as tokens_out, open(spill_dir / f"{unit_no}.spillnames", "wb") as names_out:
            writer = spill.SpillWriter(tokens_out, names_out=names_out)
            for piece in unit.payload["pieces"]:
                if "byte_range" in piece or "row_groups" in piece:
                    raise SystemExit("the parts bench reads whole .jsonl files: give it more, smaller files")
                path = piece["path"]
                lines = clock.run("read and decompress", lambda: _read(path, cfg.max_row_bytes))  # noqa: B023
                parsed = clock.run("JSON parse", lambda: _parse(lines, cfg.max_row_bytes))  # noqa: B023
                docs = clock.run("text build", lambda: _texts(parsed, cfg))  # noqa: B023
                texts = clock.run("normalize", lambda: [t.strip() if plain else normalize_text(t)  # noqa: B023
                                                        for _, _, t, plain in docs])  # noqa: B023
                keep = [i for i, t in enumerate(texts) if t]
                docs, texts = [docs[i] for i in keep], [texts[i] for i in keep]
                ids, doc_shards = clock.run("ids and shards (md5)",
                                            lambda: _ids(docs, cfg, piece["relpath"]))  # noqa: B023
                for lo, hi in _batches(len(texts), lambda i: len(texts[i])):  # noqa: B023
                    order, tokens, lengths = clock.run(
                        "encode (a first pass)", lambda: encode_by_shard(enc, texts[lo:hi], doc_shards[lo:hi]))  # noqa: B023
                    names = ([r for r, _, _, _ in docs[lo:hi]], ids[lo:hi], [path] * (hi - lo))
                    clock.run("spill write", lambda: writer.add_batch(doc_shards[lo:hi], order, tokens,  # noqa: B023
                                                                      lengths, names))  # noqa: B023
                unit_texts += texts
            table, meta, starts = clock.run("spill write", lambda: spill.by_shard_with_meta(
                writer.close(), writer.meta, cfg.num_shards))  # noqa: B023
        for kind, array in (("spilldocs", table), ("spillmeta", meta), ("spillshards", starts)):
            with open(spill_dir / f"{unit_no}.{kind}", "wb") as f:
                clock.run("spill write", lambda: spill.write_array(f, array))  # noqa: B023
        clock.run("sha256 (spills)", lambda: [_sha256(p) for p in spill_dir.glob(f"{unit_no}.*")])  # noqa: B023
        out.append(unit_texts)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


class _Plain(io.RawIOBase):
    """A plain writer to a local file (no hash, no fsync), as ``open_write`` wants."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return int(self.f.write(data))


def pack_parts(cfg: PrepConfig, clock: Clock, spill_dir: Path, out_dir: Path) -> None:
    """Each pack part over every shard, from the spills :func:`tokenize_parts` wrote."""
    units = sorted({p.name.split(".")[0] for p in spill_dir.glob("*.spill")}, key=int)
    sources = [spill.spill_files(str(spill_dir), u) for u in units]

    def plain(path: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def cm() -> Iterator[Any]:
            with open(path, "wb") as f:
                yield _Plain(f)
        return cm()

    for shard in range(cfg.num_shards):
        found = clock.run("pack read", lambda: [p for p in (pack.read_shard_piece(s, shard, None)  # noqa: B023
                                                             for s in sources) if p is not None])
        chunks = clock.run("pack read", lambda: list(pack.token_chunks(found)))  # noqa: B023
        npy, idx = str(out_dir / f"{shard}.npy"), str(out_dir / f"{shard}.idx")
        clock.run("pack write (.npy, .idx)", lambda: shards.write_shard(  # noqa: B023
            plain, npy, idx, pack.shard_lengths(found), chunks, cfg.tokenizer.dtype))  # noqa: B023
        clock.run("sidecar (.docs.parquet)", lambda: provenance.write_docs(  # noqa: B023
            plain, str(out_dir / f"{shard}.docs.parquet"), pack.doc_batches(found)))  # noqa: B023
        clock.run("sha256 (shards)", lambda: [_sha256(Path(p)) for p in (npy, idx)])  # noqa: B023


def encoder_alone(enc: Any, texts: list[list[str]]) -> float:
    """CPU seconds of the encoder alone over the normalized texts, in prep's batches."""
    t0 = time.process_time()
    for unit_texts in texts:
        for lo, hi in _batches(len(unit_texts), lambda i: len(unit_texts[i])):  # noqa: B023
            encode_documents(enc, unit_texts[lo:hi])
    return time.process_time() - t0


def stages(cfg: PrepConfig) -> dict[str, float]:
    """CPU seconds of each stage as it runs (every unit, in this process, its receipt written),
    and its wall seconds (``wall: stage NAME``: fsync's waits too)."""
    shutil.rmtree(cfg.output, ignore_errors=True)
    runs = bind_stages(build_stages(cfg), cfg.output)
    out: dict[str, float] = {}
    for run in runs:
        t0, c0 = time.perf_counter(), time.process_time()
        for unit in run.stage.plan():
            receipt = execute_unit(run, unit)
            if receipt.get("status") != "completed":
                raise SystemExit(f"{run.stage.name} unit {unit.id} failed: {receipt.get('error')}")
        out[f"stage {run.stage.name}"] = time.process_time() - c0
        out[f"wall: stage {run.stage.name}"] = time.perf_counter() - t0
    return out


def measure_round(corpus: Path, work: Path) -> dict[str, float]:
    """One round: the parts, the encoder alone, the stages; seconds by name."""
    cfg = PrepConfig(storage.expand_inputs([str(corpus)]), str(work / "out-parts-stages"), "bench")
    enc = load_tokenizer(cfg.tokenizer, cfg.encoder)
    clock = Clock()
    spill_dir, out_dir = work / "parts-spills", work / "parts-shards"
    for d in (spill_dir, out_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    gc.collect()
    texts = tokenize_parts(cfg, enc, clock, spill_dir)
    pack_parts(cfg, clock, spill_dir, out_dir)
    result = dict(clock.seconds)
    result["encoder alone"] = encoder_alone(enc, texts)
    result["documents"] = float(sum(map(len, texts)))
    del texts
    result.update(stages(cfg))
    result["load"] = os.getloadavg()[0]
    return result


def print_parts(title: str, rounds: dict[str, list[dict[str, float]]]) -> None:
    """The table: a column per version (its medians), each part's seconds and x the encoder alone."""
    cols = list(rounds)
    for c in cols:  # what a stage's parts leave out, in each round
        for r in rounds[c]:
            for stage, parts in (("tokenize", TOKENIZE_PARTS), ("pack", PACK_PARTS)):
                r[f"rest of {stage}"] = r[f"stage {stage}"] - sum(r.get(p, 0.0) for p in parts)
    med = {c: {k: statistics.median(r[k] for r in rounds[c] if k in r) for k in rounds[c][0]} for c in cols}
    print(f"\n{title} (CPU seconds of this process, medians of {max(map(len, rounds.values()))} rounds; "
          f"'x enc': the part / the encoder alone; load average at each round's end: "
          + "; ".join(f"{c} " + ", ".join(f"{r['load']:.1f}" for r in rounds[c]) for c in cols) + ")")
    print(f"  {'part':52s}" + "".join(f"{c:>12s}{'x enc':>7s}" for c in cols))

    def row(label: str, key: str) -> None:
        cells = [(med[c].get(key, 0.0), med[c]["encoder alone"]) for c in cols]
        print(f"  {label:52s}" + "".join(f"{v:12.2f}{v / enc:7.2f}" for v, enc in cells))

    for stage, parts in (("tokenize", TOKENIZE_PARTS), ("pack", PACK_PARTS)):
        for part in parts:
            row(part, part)
        row(f"rest of {stage} (renames, receipts, interplay)", f"rest of {stage}")
        row(f"stage {stage} (as run)", f"stage {stage}")
    row("encoder alone (the ceiling)", "encoder alone")
    row("wall seconds: stage tokenize (as run)", "wall: stage tokenize")
    row("wall seconds: stage pack (as run)", "wall: stage pack")
    for c in cols:
        ratios = [r["encoder alone"] / r["stage tokenize"] for r in rounds[c]]
        print(f"  {c}: tokenize stage at {statistics.median(ratios):.0%} of the encoder alone's throughput "
              f"[{min(ratios):.0%}-{max(ratios):.0%}] (goal >= 50%); tokenize + pack at "
              f"{med[c]['encoder alone'] / (med[c]['stage tokenize'] + med[c]['stage pack']):.0%}; "
              f"{med[c]['documents']:,.0f} documents")
    if len(cols) == 2:
        a, b = cols
        ratios = [(x["stage tokenize"] + x["stage pack"]) / (y["stage tokenize"] + y["stage pack"])
                  for x, y in zip(rounds[a], rounds[b])]
        print(f"  tokenize + pack, {a} / {b} (rounds alternating): {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")


def bare_scaling(texts: list[str], n: int) -> float:
    """How much faster ``n`` processes run prep's encoder alone (``encode_documents`` over
    ``texts`` in prep's batches; forked from this process, its encoder built before) than one
    process alone, now: the machine's own ceiling on ``n`` workers against 1."""
    enc = load_tokenizer(PrepConfig([], "", "bench").tokenizer, "fast")
    batches = [texts[lo:hi] for lo, hi in _batches(len(texts), lambda i: len(texts[i]))]
    encode_documents(enc, batches[0][:16])  # (built, and its first call made, before the forks)

    def timed(k: int) -> float:
        t0 = time.perf_counter()
        pids = []
        for _ in range(k):
            pid = os.fork()
            if pid == 0:
                for b in batches:
                    encode_documents(enc, b)
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        return time.perf_counter() - t0

    alone = timed(1)
    return n * alone / timed(n)
