"""Helpers the tests share: GSM8K text (shipped in tests/data), JSONL writers, a prep run,
digests of an output tree. Fixtures are in conftest.py; tests import these from here."""
from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"  # shipped with the repo (MIT, see its LICENSE)
GSM8K_TEST = GSM8K / "test.jsonl.gz"
GSM8K_TRAIN = GSM8K / "train.jsonl.gz"


def gsm8k_rows(split: str) -> list[dict[str, Any]]:
    """The GSM8K ``test`` or ``train`` rows ({"question", "answer"}), in file order."""
    with gzip.open(GSM8K / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def gsm8k_texts(n: int, offset: int = 0) -> list[str]:
    """``n`` GSM8K train documents (question + answer) from row ``offset`` on."""
    return [r["question"] + "\n\n" + r["answer"] for r in gsm8k_rows("train")[offset:offset + n]]


def write_jsonl(path: Path, rows: list[Any], raw_lines: dict[int, str] | None = None) -> Path:
    """Rows as JSON lines; ``raw_lines`` inserts verbatim (possibly broken) lines at positions."""
    lines = [json.dumps(r) for r in rows]
    for pos, raw in sorted((raw_lines or {}).items()):
        lines.insert(pos, raw)
    data = ("\n".join(lines) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        import zstandard
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def run_prep(inputs: str | Path | Sequence[str | Path], output: str | Path, *extra: object,
             runner: str = "direct") -> int:
    from refinery.beam_pipelines.cli import main

    args = ["prep", "--input", *map(str, inputs if isinstance(inputs, (list, tuple)) else [inputs]),
            "--output", str(output), "--runner", runner, "--no-progress", *map(str, extra)]
    return main(args)


def file_digest(path: Path) -> str:
    """sha256 of an output file; for a ``manifest.json``, of its content without ``created_at``
    (the time of its plan's first run in that folder: the one field in which two separate runs
    of the same plan may differ; a rerun in the same folder keeps it)."""
    import hashlib

    data = path.read_bytes()
    if path.name == "manifest.json":
        manifest = json.loads(data)
        manifest.pop("created_at", None)
        data = json.dumps(manifest, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    """:func:`file_digest` of every user-facing output file (not the .refinery metadata)."""
    return {str(p.relative_to(root)): file_digest(p)
            for p in sorted(root.rglob("*")) if p.is_file() and ".refinery" not in p.parts}


def word_shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """refinery dedup's shingle set of ``text`` as docs/DEDUP.md says it, in plain Python (the
    tests' oracle): lowercased, words = runs of ASCII letters and digits and non-ASCII
    characters, every n consecutive words (fewer words: one shingle of all of them)."""
    import re

    words = re.findall(r"[0-9a-z\u0080-\U0010ffff]+", text.lower())
    if not words:
        return set()
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def shingle_jaccard(a: str, b: str) -> float:
    """The Jaccard of the :func:`word_shingles` of two texts (1 for two texts of no word)."""
    sa, sb = word_shingles(a), word_shingles(b)
    return 1.0 if not sa and not sb else len(sa & sb) / len(sa | sb)
