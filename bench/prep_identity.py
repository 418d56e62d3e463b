"""Byte identity of ``refinery prep``'s outputs across a change: runs prep on several fixtures
and records the sha256 of every user-facing output file (the shards' ``.npy``, ``.idx`` and
``.docs.parquet``, ``rejects/rejects.jsonl``, and ``manifest.json`` without its
``created_at``), or checks them against a recorded file.

    .venv/bin/python bench/prep_identity.py --workdir W --record /tmp/prep-ids-before.json   # the code before
    .venv/bin/python bench/prep_identity.py --workdir W --check /tmp/prep-ids-before.json    # the code after

The same ``--workdir`` both times: the manifests name the inputs' paths. The fixtures:
``examples/sample_corpus``; GSM8K-derived text (bench/prep.py's corpus, 4 files); web-like
text in one file split by byte ranges (``--unit-mb 1``); a hostile corpus (JSON escapes of
every kind, non-ASCII, NFD, controls and DEL, CR LF, blank lines, over-cap rows with
``--max-row-bytes``, bad JSON, duplicate keys, lone surrogates, nested values, ids of every
JSON type or none, texts that are not strings or are chat lists) as ``.jsonl``, ``.jsonl.gz``,
``.json``, ``.parquet`` and a truncated gzip, with the text field, and with a template.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prep import corpus_texts, web_texts, write_layout  # noqa: E402  (bench/prep.py: the same corpora)

ROOT = HERE.parent


def hostile_lines(rnd: random.Random) -> list[bytes]:
    texts = ["plain", "  padded\t\n ", "", " ", "caf\u00e9", "e\u0301t\u00e9", "a\x7fb", "cr\r\nlf\r", "nul\x00x",
             "\u4e2d\u6587", "\U0001f600", "back\\slash", 'q"uote', "\x85\u2028", "\u00a0nb\u00a0", "\u1100\u1161"]
    ids: list[Any] = [None, 7, -3, 1.5, True, "s", "\u00e9", "\ud800", 123456789012345678901234, [1], {"a": 1}]
    out = []
    for i in range(3000):
        r = rnd.random()
        text: Any = rnd.choice(texts) + f" {i}"
        if r < 0.03:
            text = rnd.choice([5, None, ["a"], [{"role": "user", "content": "hi"}], [{"role": 1}]])
        record: dict[str, Any] = {"text": text, "id": rnd.choice(ids) if rnd.random() < 0.3 else f"h{i}"}
        if rnd.random() < 0.05:
            del record["id"]
        if rnd.random() < 0.05:
            record["meta"] = {"deep": [[1, 2.5], {"x": None}]}
        line = json.dumps(record, ensure_ascii=rnd.random() < 0.5).encode("utf-8", "surrogatepass")
        out.append(line + rnd.choice([b"\n", b"\r\n"]))
        if rnd.random() < 0.02:
            out.append(rnd.choice([b"\n", b"  \n", b"not json\n", b'{"text": "dup", "text": "last", "id": "d"}\n',
                                   b'{"text": "\\ud800 lone", "id": "l"}\n', b'{"text": "' + b"z" * 900 + b'"}\n',
                                   b'{"text": "\xff bad utf-8"}\n', b'[1, 2]\n']))
    return out


def fixtures(work: Path) -> dict[str, list[str]]:
    """Case name -> the prep arguments (inputs written under ``work`` once)."""
    gsm = work / "in-gsm8k"
    if not gsm.exists():
        write_layout(gsm, corpus_texts(20), 4)
    web = work / "in-web"
    if not web.exists():
        write_layout(web, web_texts(6), 1)
    hostile = work / "in-hostile"
    if not hostile.exists():
        hostile.mkdir(parents=True)
        lines = hostile_lines(random.Random(60))
        (hostile / "a.jsonl").write_bytes(b"".join(lines[:1000]))
        (hostile / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[1000:2000]), mtime=0))
        (hostile / "c-cut.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[2000:2600]), mtime=0)[:-300])
        records = [json.loads(x) for x in lines[2600:] if x.strip() and x[:1] == b"{" and b"\xff" not in x
                   and b"\\ud800" not in x]
        (hostile / "d.json").write_text(json.dumps(records))
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [f"p{i}" for i in range(300)],
                                 "text": [f"parquet row {i} caf\u00e9" * (i % 5) for i in range(300)]}),
                       hostile / "e.parquet", row_group_size=64)
    return {
        "sample_corpus": ["--input", str(ROOT / "examples" / "sample_corpus")],
        "gsm8k-20MB": ["--input", str(gsm), "--num-shards", "8"],
        "web-byte-ranges": ["--input", str(web), "--unit-mb", "1", "--num-shards", "3"],
        "hostile": ["--input", str(hostile), "--max-row-bytes", "600", "--num-shards", "5", "--max-reject-rate", "1"],
        "hostile-failed": ["--input", str(hostile), "--num-shards", "4"],  # (the cut gzip: FAILED.json)
        "hostile-template": ["--input", str(hostile), "--text-template", "[{id}] {text}", "--num-shards", "2",
                             "--max-reject-rate", "1"],
    }


def digests(out: Path) -> dict[str, str]:
    found = {}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if not path.is_file() or rel.startswith(".refinery"):
            continue
        data = path.read_bytes()
        if rel == "manifest.json":
            manifest = json.loads(data)
            manifest.pop("created_at", None)
            data = json.dumps(manifest, sort_keys=True).encode()
        found[rel] = hashlib.sha256(data).hexdigest()
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="inputs and outputs (the same for --record and --check)")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", metavar="FILE")
    group.add_argument("--check", metavar="FILE")
    args = ap.parse_args()
    work = Path(args.workdir)
    results: dict[str, dict[str, Any]] = {}
    for name, argv in fixtures(work).items():
        out = work / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", *argv, "--output",
                               str(out), "--dataset", "ident", "--workers", "1", "--no-progress"],
                              capture_output=True, text=True)
        results[name] = {"exit": done.returncode, "files": digests(out)}
        print(f"{name}: exit {done.returncode}, {len(results[name]['files'])} files", flush=True)
    if args.record:
        Path(args.record).write_text(json.dumps(results, indent=1, sort_keys=True))
        return
    recorded: dict[str, dict[str, Any]] = json.loads(Path(args.check).read_text())
    empty = [name for name, r in {**recorded, **results}.items() if not r["files"]]
    if empty:  # (a run that wrote nothing compares equal to another that wrote nothing)
        sys.exit(f"no output files for {', '.join(sorted(set(empty)))}: the runs failed before writing")
    bad = [f"{name}: {what}" for name in recorded for what in
           ([f"exit {results[name]['exit']} (recorded {recorded[name]['exit']})"]
            if results[name]["exit"] != recorded[name]["exit"] else [])
           + [f"{f} differs" for f in sorted(set(recorded[name]["files"]) | set(results[name]["files"]))
              if recorded[name]["files"].get(f) != results[name]["files"].get(f)]]
    print("\n".join(bad) if bad else f"identical: {sum(len(r['files']) for r in results.values())} files "
          f"in {len(results)} cases")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
