"""decon's match key (issue 58, item 10): ``--match-fold nfkc-cf`` (the default) folds both
sides' normalized text before matching, ``none`` keeps HELM's exact text.

Before: text that is the same to a reader but not to the matcher (soft hyphens, zero-width
and other format characters inside words, fullwidth letters, ligatures) leaked: 0 of 6
listed per variant. Now: format characters (Cf) are dropped, then NFKC, on both sides; the
offsets decon reports still index the raw row text (details, spans: what prep's span mode
and refinery clean cut), prep's own text stays as it is, and the fold is recorded in the
stage hashes and the drop list's ``train_files.jsonl``.
"""
from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from helpers import run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.decon.ngrams.normalized import match_offsets, match_text, tokens_with_offsets
from refinery.transforms.formats.droplist import TRAIN_FILES, match_fold_problem
from refinery.transforms.io import storage
from refinery.transforms.io.text import fold_text, fold_texts, folded_offsets, normalize_text, raw_spans
from refinery.transforms.prep import exclusion

DEFAULT = ng.get_tokenizer("default")
EXACT = ng.get_tokenizer("default", "none")
CF = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf"]


def definition(text: str) -> str:
    """The fold, step by step: every Cf code point dropped; NFKC; the ends stripped."""
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return unicodedata.normalize("NFKC", text).strip()


def test_the_fold_is_its_definition_on_every_code_point() -> None:
    # each code point in blocks of 127 with a mark, a ligature and a zero-width space after them:
    # the lookup tables (format characters, one-to-one NFKC maps) against unicodedata itself
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for at in range(0, len(cps), 127):
        text = normalize_text("x" + "".join(map(chr, cps[at:at + 127])) + "\u0301\ufb01\u200b")
        assert fold_text(text, "nfkc-cf") == definition(text), hex(cps[at])
        assert fold_text(text, "none") == text


POOL = (CF[:8] + ["\u00ad", "\u200b", "\u200c", "\u200d", "\u200e", "\u2060", "\ufeff", "\U000e0041"]
        + ["\ufb01", "\ufb03", "\uff21", "\uff41", "\uff10", "\uff1f", "\u00b2", "\u2460", "\u3000", "\u00a8", "\u1e9b",
           "\uff76", "\uff9e", "\uffa1", "\uffc2", "\u3131", "\u33a1", "\u2126", "\u212b", "\ufdfa"]
        + ["a", "e", "f", "i", " ", ".", "\u0301", "\u0323", "\u0308", "\u3099", "\u1100", "\u1161", "\u11a8", "\n"])


def generated(seed: int, count: int) -> list[str]:
    """Strings of format characters, compatibility forms (ligatures, fullwidth, halfwidth
    kana and jamo, circled digits, spacing accents), combining marks and jamo, in every order,
    with code points of every plane."""
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        parts = [rnd.choice(POOL) if rnd.random() < 0.85 else chr(rnd.randrange(0xE000, 0x110000))
                 for _ in range(rnd.randrange(16))]
        out.append("".join(parts))
    return out


def test_the_fold_is_a_fixed_point_and_its_offsets_slice_the_raw_text() -> None:
    checked = 0
    for raw in generated(10, 1500):
        norm = normalize_text(raw)
        key = fold_text(norm, "nfkc-cf")
        assert key == definition(norm) and fold_text(key, "nfkc-cf") == key, ascii(raw)
        assert normalize_text(key) == key  # the key is normalized text too
        got, start, end = folded_offsets(norm, "nfkc-cf")
        assert got == key and len(start) == len(end) == len(key) and (start < end).all(), ascii(raw)
        # the raw text's map (the normalization's, then the fold's): spans between the pieces the
        # fold changes apart map to raw text whose match text is the span
        mapped, start, end = match_offsets(DEFAULT, raw)
        assert mapped == key == match_text(DEFAULT, raw)
        firsts = [s for s in range(len(key)) if s == 0 or start[s] >= end[s - 1]]
        lasts = [e for e in range(1, len(key) + 1) if e == len(key) or end[e - 1] <= start[e]]
        for s in firsts[:4]:
            for e in [e for e in lasts if e > s][:4]:
                a, b = raw_spans(start, end, np.array([s]), np.array([e]), len(raw))
                assert match_text(DEFAULT, raw[int(a[0]):int(b[0])]) == key[s:e].strip(), (ascii(raw), s, e)
                checked += 1
    assert checked > 1500


def test_the_scan_folds_a_batch_as_it_folds_each_text() -> None:
    """fold_texts (the scan's batches, one table lookup for all their non-ASCII rows) is
    fold_text of each text; a text the fold leaves alone is handed back as it is."""
    rnd = random.Random(11)
    texts = [normalize_text(t) for t in generated(12, 2000)] + ["plain ASCII", "caf\u00e9 as it is", ""]
    for _ in range(300):
        batch = rnd.sample(texts, rnd.randrange(1, 30))
        assert fold_texts(batch, "nfkc-cf") == [fold_text(t, "nfkc-cf") for t in batch]
        assert fold_texts(batch, "none") is batch
    kept = ["caf\u00e9 as it is", "x\u00ady", "plain"]
    got = fold_texts(kept, "nfkc-cf")
    assert got == ["caf\u00e9 as it is", "xy", "plain"] and got[0] is kept[0] and got[2] is kept[2]


def test_clean_ascii_is_its_own_key_and_costs_one_isascii() -> None:
    text = "A plain ASCII row, as most are."
    assert fold_text(text, "nfkc-cf") is text and match_text(DEFAULT, text) is text
    with pytest.raises(ValueError, match="unknown match fold 'nfkc'"):
        fold_text(text, "nfkc")
    with pytest.raises(ValueError, match="unknown match fold"):
        ng.get_tokenizer("default", "nfkc")


def test_token_offsets_under_the_fold_index_the_raw_text() -> None:
    raw = "\ufeffＣａｆé ﬁnd so\u00adft ze\u200bro x\u0301"
    toks, spans = tokens_with_offsets(DEFAULT, raw)
    assert toks == ["café", "find", "soft", "zero", "x\u0301"]
    assert [raw[s:e] for s, e in spans] == ["Ｃａｆé", "ﬁnd", "so\u00adft", "ze\u200bro", "x\u0301"]
    assert tokens_with_offsets(EXACT, raw)[0] == ["\ufeffｃａｆé", "ﬁnd", "so\u00adft", "ze\u200bro", "x\u0301"]


QUESTIONS = [  # (id, eval question): ASCII, each more than 13 tokens
    ("q0", "Tom finds fifteen shiny shells on the beach and gives five of them to his sister; how many are left?"),
    ("q1", "A florist sells forty flowers each morning and twice as many each afternoon; how many flowers a day?"),
    ("q2", "Mia reads twelve pages of her book every evening for three weeks in a row; how many pages in all?"),
    ("q3", "The office buys nine boxes of paper with five hundred sheets in each box; how many sheets are there?"),
    ("q4", "Sam swims four laps before school and six laps after school on each weekday; how many laps a week?"),
    ("q5", "A baker fills eight trays with eleven muffins each and sells all but seven; how many does she sell?"),
]


def _inside(question: str, mark: str, every: int = 1) -> str:
    """``mark`` after the first letter of every ``every``-th word."""
    return " ".join(w[:1] + mark + w[1:] if i % every == 0 and len(w) > 1 else w
                    for i, w in enumerate(question.split(" ")))


VARIANTS: dict[str, Callable[[str], str]] = {  # name -> the question as a training row holds it, to a reader the same
    "fullwidth": lambda q: "".join(chr(ord(c) + 0xFEE0) if c.isascii() and c.isalnum() else c for c in q),
    "ligature": lambda q: q.replace("fi", "\ufb01").replace("fl", "\ufb02").replace("ff", "\ufb00"),
    "soft_hyphen": lambda q: _inside(q, "\u00ad"),
    "zero_width": lambda q: _inside(q, "\u200b").replace(" a", " \u200da").replace("e", "\u200ce", 2),
    "direction_marks": lambda q: _inside(q, "\u200e", 2).replace("o", "o\u200f", 3),
    "word_joiner_bom": lambda q: _inside(q, "\u2060", 3).replace("s", "\ufeffs", 2),
}
INTRO = "Some words first. "


def _training(tmp_path: Path) -> tuple[Path, Path, dict[int, tuple[str, str]]]:
    """(training folder, eval file, row -> (variant, raw question as planted))."""
    rows = [{"id": f"d{i}", "text": f"Row {i} talks about the harbour, the weather and trains at {i} o'clock."}
            for i in range(30)]
    planted = {}
    for k, (name, vary) in enumerate(VARIANTS.items()):
        at = 2 + 4 * k
        raw = vary(QUESTIONS[k][1])
        assert raw != QUESTIONS[k][1] and normalize_text(raw) == raw  # prep trains on it as it is
        rows[at]["text"] = f"{INTRO}{raw}\nAnd after."
        planted[at] = (name, raw)
    write_jsonl(tmp_path / "corpus" / "train.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval" / "quiz" / "test.jsonl", [{"id": i, "text": q} for i, q in QUESTIONS])
    return tmp_path / "corpus", evals, planted


def _decon(train: Path, evals: Path, out: Path, *extra: object) -> int:
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "13",
                 "--partitions", "2", "--runner", "direct", "--no-progress", *map(str, extra)])


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_decon_matches_what_a_reader_sees_and_reports_raw_offsets(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # before: 0 of these 6 rows listed, exit 0; prep trained on every one of them
    train, evals, planted = _training(tmp_path)
    assert _decon(train, evals, tmp_path / "decon") == 0
    listed = {d["train_row"] for d in _jsonl(tmp_path / "decon/stats/contaminated_train_docs.jsonl")}
    assert listed == set(planted)
    texts = {r: f"{INTRO}{raw}\nAnd after." for r, (_, raw) in planted.items()}
    # each row's span: from the question's first character to the end of its last word, in the raw text
    for entry in _jsonl(tmp_path / "decon/stats/contaminated_train_spans.jsonl"):
        row = int(entry["train_row"])
        raw = planted[row][1]
        assert entry["spans"] == [[len(INTRO), len(INTRO) + raw.rindex("?")]], planted[row][0]
    details = list(read_details(str(tmp_path / "decon")))
    assert {d["train_row"] for d in details} == set(planted) and len(details) > 6 * 5
    for d in details:  # the raw slice at each offset is the n-gram, once folded
        for s, e in d["train_offsets"]:
            assert " ".join(DEFAULT.tokenize(match_text(DEFAULT, texts[d["train_row"]][s:e]))) == d["ngram"]
    files = _jsonl(tmp_path / "decon" / TRAIN_FILES)
    assert {f["match_fold"] for f in files} == {"nfkc-cf"}
    assert "<bdi>match fold</bdi></th><td><bdi>nfkc-cf</bdi>" in (tmp_path / "decon/stats/report.html").read_text()

    # prep drops them (its text is not folded), and says which fold decon matched under
    capsys.readouterr()
    assert run_prep([train], tmp_path / "rows", "--exclude-overlaps", tmp_path / "decon") == 0
    said = capsys.readouterr()
    assert "found overlapping at n=13 (matched under --match-fold nfkc-cf)" in said.out + said.err
    manifest = json.loads((tmp_path / "rows" / "manifest.json").read_text())
    assert manifest["rows"]["excluded"] == 6
    assert manifest["excluded_overlaps"]["decon_runs"][0]["match_fold"] == "nfkc-cf"
    # span mode cuts the raw spans: what is left of each planted row is its text around the question
    assert run_prep([train], tmp_path / "spans", "--exclude-overlaps", tmp_path / "decon", "--exclude-mode", "span",
                    "--exclude-window", 0, "--exclude-min-chars", 1) == 0
    cut = json.loads((tmp_path / "spans" / "manifest.json").read_text())["excluded_overlaps"]
    assert cut["documents"] == 6 and cut["decon_runs"][0]["match_fold"] == "nfkc-cf"


def test_match_fold_none_is_helms_exact_text(tmp_path: Path) -> None:
    train, evals, planted = _training(tmp_path)
    assert _decon(train, evals, tmp_path / "exact", "--match-fold", "none", "--min-eval-tokens", 0) == 0
    assert _jsonl(tmp_path / "exact/stats/contaminated_train_docs.jsonl") == []
    assert {f["match_fold"] for f in _jsonl(tmp_path / "exact" / TRAIN_FILES)} == {"none"}
    # the question itself is still found under none: the fold is all that differs
    rows = [json.loads(line) for line in (train / "train.jsonl").read_text().splitlines()]
    rows[0]["text"] = QUESTIONS[0][1]
    write_jsonl(train / "train.jsonl", rows)
    assert _decon(train, evals, tmp_path / "exact2", "--match-fold", "none", "--min-eval-tokens", 0) == 0
    assert [d["train_row"] for d in _jsonl(tmp_path / "exact2/stats/contaminated_train_docs.jsonl")] == [0]
    assert not set(planted) & {0}


def test_the_eval_side_is_folded_too(tmp_path: Path) -> None:
    """A ligature or a soft hyphen in the eval question: the plain training text matches it."""
    q = QUESTIONS[0][1]
    write_jsonl(tmp_path / "corpus" / "train.jsonl", [{"id": "d0", "text": f"Before. {q} After."}])
    evals = write_jsonl(tmp_path / "eval" / "quiz" / "test.jsonl",
                        [{"id": "lig", "text": VARIANTS["ligature"](q)}, {"id": "shy", "text": _inside(q, "\u00ad")}])
    assert _decon(tmp_path / "corpus", evals, tmp_path / "decon") == 0
    (stats,) = _jsonl(tmp_path / "decon/stats/overlap_stats.jsonl")
    assert stats["instance_ids"] == ["lig", "shy"]
    assert _decon(tmp_path / "corpus", evals, tmp_path / "exact", "--match-fold", "none") == 0
    (stats,) = _jsonl(tmp_path / "exact/stats/overlap_stats.jsonl")
    assert stats["instance_ids"] == []


def test_the_fold_enters_the_stage_hashes_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    from refinery.beam_pipelines.decon import build_parser, settings_from_args
    from refinery.transforms.decon.stages import build_stages
    from refinery.transforms.resumable import short_hash

    ev = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"id": 1, "text": "a b c"}])
    tr = write_jsonl(tmp_path / "train.jsonl", [{"id": 1, "text": "a b c"}])

    def configs(*extra: str) -> list[str]:
        args = build_parser().parse_args(["--eval", str(ev), "--train", str(tr), "--output", "o", *extra])
        settings = settings_from_args(args)
        return [short_hash({"settings": dict(c.settings), "identity": dict(c.identity)})
                for c in (s.config() for s in build_stages(settings)[:2])]

    assert build_parser().parse_args(["--eval", "e", "--train", "t", "--output", "o"]).match_fold == "nfkc-cf"
    folded, exact = configs(), configs("--match-fold", "none")
    assert folded[0] != exact[0] and folded[1] != exact[1]  # index and scan: recomputed under another fold
    assert configs("--match-fold", "nfkc-cf") == folded
    # a drop list that records no fold, or one this refinery does not know: refused, naming it
    assert match_fold_problem([{"match_fold": "nfkc-cf"}, {"match_fold": "nfkc-cf"}]) is None
    assert "records no match fold" in str(match_fold_problem([{"train_path": "t"}]))
    assert "records the match fold(s) 'nfkc-cf', 'none'" in str(
        match_fold_problem([{"match_fold": "nfkc-cf"}, {"match_fold": "none"}]))
    from refinery.transforms.formats.droplist import ReadSpec
    from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
    from refinery.transforms.io.text import TEXT_NORMALIZATION

    spec = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)
    row = {"train_path": "t", "resolved": "/t", "size": 1, "version": "1", **spec.record(), "match_fold": "nfkc-9"}
    with pytest.raises(storage.InputError, match="records the match fold\\(s\\) 'nfkc-9'"):
        exclusion.check_read_spec("d", [row], spec)
