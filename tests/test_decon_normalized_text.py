"""decon n-grams the text prep trains on (issue 46, item 2) and skips eval rows too short to
mean anything (F15): the shared normalization, its offset map, the scan's offsets into the
row's text, decon -> prep --exclude-overlaps end to end, and --min-eval-tokens."""
from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from helpers import gsm8k_rows, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.normalized import match_text, tokens_with_offsets
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.io.text import normalize_text, normalized_offsets, raw_spans
from refinery.transforms.prep import documents

DEFAULT = ng.TOKENIZERS["default"]
QUESTION = ("José's café served twelve crêpes to Zoë and André before noon, and then eight more to "
            "the Müller family; how many crêpes were served?")


def _unstripped(text: str) -> str:
    """normalize_text's definition, but the strip (a span inside a text is not stripped)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return unicodedata.normalize("NFC", "".join(c for c in text if unicodedata.category(c) != "Cc" or c in "\t\n"))


def test_prep_and_decon_share_one_normalization() -> None:
    assert vars(documents)["normalize_text"] is normalize_text  # prep's name for it is the shared function


def test_offset_map_spans_are_the_raw_text_of_the_normalized_text() -> None:
    pool = list("abc XY.,\t\n\r<=") + ["\r\n", "e\u0301", "A\u030a", "\u0301", "\u0327", "\u0338", "\x85", "\x9f",
                                        "\x00", "\u200b", "\u212b", "\u1100\u1161", "\u11a8", "\uac00",
                                        "\u0b47\u0b3e", "\u0f73", "\u0344", "é", "\u00a0", "ﬁ", "Ａ"]
    rnd = random.Random(46)
    checked = 0
    for _ in range(2000):
        raw = "".join(rnd.choice(pool) for _ in range(rnd.randrange(0, 30)))
        norm, start, end = normalized_offsets(raw)
        assert norm == normalize_text(raw), ascii(raw)
        assert len(start) == len(end) == len(norm) and (start < end).all() and (end <= len(raw)).all()
        # spans whose ends are between the pieces NFC normalizes apart
        firsts = [s for s in range(len(norm)) if s == 0 or start[s] >= end[s - 1]]
        lasts = [e for e in range(1, len(norm) + 1) if e == len(norm) or end[e - 1] <= start[e]]
        for s in firsts[:6]:
            for e in [e for e in lasts if e > s][:6]:
                a, b = raw_spans(start, end, np.array([s]), np.array([e]), len(raw))
                assert _unstripped(raw[int(a[0]):int(b[0])]) == norm[s:e], (ascii(raw), s, e)
                checked += 1
    assert checked > 10_000
    # a clean text is its own map; an empty span sits where its character starts
    norm, start, end = normalized_offsets("  ab\r\nc\x85d ")
    assert norm == "ab\ncd" and start.tolist() == [2, 3, 4, 6, 8] and end.tolist() == [3, 4, 6, 7, 9]
    assert [x.tolist() for x in raw_spans(start, end, np.array([0, 5]), np.array([0, 5]), 11)] == [[2, 9], [2, 9]]


VARIANTS = {  # name -> (the question as a training row holds it, does prep train on the eval text?)
    "nfd": (unicodedata.normalize("NFD", QUESTION), True),
    "c1": (" ".join(w[:1] + "\x9f" + w[1:] for w in QUESTION.split(" ")), True),           # inside each word
    "nel": (" ".join(w[:2] + "\x85" + w[2:] if len(w) > 2 else w for w in QUESTION.split(" ")), True),
    "crlf": (QUESTION.replace(", ", ",\r\n").replace("; ", ";\r\r\n"), True),
    # prep keeps these as they are (NFC, not NFKC; U+200B is Cf, not Cc), but they are the question to a
    # reader: decon's match fold (--match-fold nfkc-cf, the default) finds them, and prep leaves them out
    "fullwidth": ("".join(chr(ord(c) + 0xFEE0) if c.isascii() and c.isalnum() else c for c in QUESTION), False),
    "zero_width": (" ".join(w[:1] + "\u200b" + w[1:] for w in QUESTION.split(" ")), False),
}
FOLDED = {"fullwidth", "zero_width"}  # found by the match fold alone


def test_scan_finds_normalized_variants_with_offsets_into_the_row() -> None:
    nfd = {"id": "q", "text": unicodedata.normalize("NFD", QUESTION)}
    rows, _ = ng.eval_rows_of([("ds", "x/ds/test.jsonl", 0, nfd)], "text", "id", DEFAULT)
    index = ng.build_index(rows, [5], DEFAULT)
    parts = {p: ng.Partition(recs) for p, recs in ng.partition_records(index, 4).items()}
    # eval offsets index the eval row's own (NFD) text
    for (_, gram), (_, evals) in index.items():
        for s, e in evals[0][1]:
            assert " ".join(DEFAULT.tokenize(normalize_text(rows[0].text[s:e]))) == gram
    membership = ng.Membership([v[0] for v in index.values()], {k[0] for k in index}, {"ns": [5]})
    texts = [f"Before: {text}\r\n after." for text, _ in VARIANTS.values()]
    stats = ng.ScanStats()
    hits = list(ng.scan_rows(((i, {"text": t}, None) for i, t in enumerate(texts)), text_field="text",
                             tokenizer=DEFAULT, membership=membership, lookup=lambda p: parts.get(p, ng.Partition([])),
                             partitions=4, stats=stats))
    found: dict[int, int] = {}
    for h in hits:
        for r, p, rec, s, e in zip(h.row.tolist(), h.partition.tolist(), h.record.tolist(), h.start.tolist(),
                                   h.end.tolist()):
            text = h.rows[r][2]
            assert " ".join(DEFAULT.tokenize(match_text(DEFAULT, text[s:e]))) == parts[p].records[rec][1]
            found[h.rows[r][0]] = found.get(h.rows[r][0], 0) + 1
    whole = len(DEFAULT.tokenize(QUESTION)) - 4 - 1  # every 5-gram of the question but its trailing empty token's
    for i, name in enumerate(VARIANTS):
        assert found.get(i, 0) >= whole, name
    assert tokens_with_offsets(DEFAULT, "x\r\nCafe\u0301")[1] == [(0, 1), (3, 8)]


def _decon(train: Path, evals: Path, out: Path, *extra: object) -> int:
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "13",
                 "--runner", "direct", "--no-progress", *map(str, extra)])


def _shard_texts(output: Path) -> list[str]:
    enc, texts = get_encoding(), []
    manifest = json.loads((output / "manifest.json").read_text())
    for s in manifest["shards"]:
        tokens = np.load(output / s["path"])
        ends = np.flatnonzero(tokens == manifest["eos_token_id"])
        start = 0
        for end in ends.tolist():
            texts.append(enc.decode(tokens[start:end].tolist()))
            start = end + 1
    return texts


def test_decon_and_prep_agree_on_every_variant_end_to_end(tmp_path: Path) -> None:
    """Each variant of the eval question planted in a training row is excluded by prep
    --exclude-overlaps: those whose normalized text (prep's) holds the eval question's n-gram,
    and those the match fold finds (fullwidth, zero-width: prep's text stays as it is); the
    shards then hold no text with it (decon of the shards' text finds nothing)."""
    train = [{"id": f"doc-{i}", "text": r["question"]} for i, r in enumerate(gsm8k_rows("train")[:60])]
    at = {}
    for k, (name, (text, _)) in enumerate(VARIANTS.items()):
        at[name] = 5 + 7 * k
        train[at[name]]["text"] = f"Some words first. {text}\r\n"
    write_jsonl(tmp_path / "corpus" / "train.jsonl", train)
    evals = write_jsonl(tmp_path / "eval" / "cafe" / "test.jsonl", [{"id": "q", "text": QUESTION}])
    assert _decon(tmp_path / "corpus", evals, tmp_path / "decon") == 0
    listed = {json.loads(line)["train_row"]
              for line in (tmp_path / "decon/stats/contaminated_train_docs.jsonl").read_text().splitlines()}
    def grams(text: str) -> set[str]:
        tokens = DEFAULT.tokenize(normalize_text(text))
        return {" ".join(tokens[i:i + 13]) for i in range(len(tokens) - 12)}

    for name, (_, same) in VARIANTS.items():
        trains_on_it = bool(grams(QUESTION) & grams(train[at[name]]["text"]))
        assert trains_on_it == same and (same or name in FOLDED), name
    assert listed == set(at.values())
    assert run_prep([tmp_path / "corpus"], tmp_path / "clean", "--num-shards", 2,
                    "--exclude-overlaps", tmp_path / "decon") == 0
    texts = _shard_texts(tmp_path / "clean")
    assert len(texts) == 60 - len(listed)
    write_jsonl(tmp_path / "shard_text" / "docs.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    assert _decon(tmp_path / "shard_text", evals, tmp_path / "decon2") == 0
    assert (tmp_path / "decon2/stats/contaminated_train_docs.jsonl").read_text() == ""


def test_short_eval_rows_are_named_and_flag_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """F15: eval rows "a", "the", "1" would flag most of 3,800 training rows; decon does not
    index them by default, names them in a warning, overlap_stats and report.md, and still
    finds the real question."""
    train = [{"id": f"doc-{i}", "text": r["question"]} for i, r in enumerate(gsm8k_rows("train")[:3800])]
    real = gsm8k_rows("test")[0]["question"]
    train[17]["text"] += " " + real
    short = {"a": "a", "the": "the", "1": "1"}
    would = sum(any(w in DEFAULT.tokenize(normalize_text(t["text"])) for w in short) for t in train)
    assert would > 3000  # what HELM's one-gram-per-short-row would flag
    write_jsonl(tmp_path / "corpus" / "train.jsonl", train)
    evals = write_jsonl(tmp_path / "eval" / "mixed" / "test.jsonl",
                        [{"id": f"s-{k}", "text": v} for k, v in short.items()] + [{"id": "real", "text": real}])
    capsys.readouterr()
    assert _decon(tmp_path / "corpus", evals, tmp_path / "decon") == 0
    err = capsys.readouterr().err
    warning = next(line for line in err.splitlines() if "--min-eval-tokens" in line)
    assert warning.startswith("WARNING refinery decon: 3 eval row(s) of fewer than 5 tokens are not indexed")
    assert all(f"(id 's-{k}', 1 token)" in warning for k in short)
    listed = [json.loads(line)["train_row"]
              for line in (tmp_path / "decon/stats/contaminated_train_docs.jsonl").read_text().splitlines()]
    assert listed == [17]
    (stats,) = [json.loads(line) for line in (tmp_path / "decon/stats/overlap_stats.jsonl").read_text().splitlines()]
    assert stats["instance_ids"] == ["real"] and stats["num_short_instances"] == 3
    assert stats["short_instance_ids"] == ["s-1", "s-a", "s-the"]
    (summary,) = [json.loads(line) for line in (tmp_path / "decon/stats/eval_summary.jsonl").read_text().splitlines()]
    assert summary["num_short_rows"] == 3 and summary["num_rows"] == 4
    assert "are not indexed (--min-eval-tokens 5" in (tmp_path / "decon/stats/report.md").read_text()
    # --min-eval-tokens 1: every row indexed, as HELM does: they flag what they would
    assert _decon(tmp_path / "corpus", evals, tmp_path / "helm", "--min-eval-tokens", 1) == 0
    helm = (tmp_path / "helm/stats/contaminated_train_docs.jsonl").read_text().splitlines()
    assert len(helm) == would + (17 not in {i for i, t in enumerate(train)
                                            if any(w in DEFAULT.tokenize(t["text"]) for w in short)})


def test_the_cli_default_is_the_library_default() -> None:
    from refinery.beam_pipelines.decon import build_parser
    from refinery.transforms.decon.ngrams.index import DEFAULT_MIN_EVAL_TOKENS
    from refinery.transforms.decon.stages import DeconSettings

    args = build_parser().parse_args(["--eval", "e", "--train", "t", "--output", "o"])
    assert args.min_eval_tokens == DEFAULT_MIN_EVAL_TOKENS == DeconSettings([], [], [13]).min_eval_tokens == 5


def test_token_count_is_the_length_and_emptiness_of_the_tokens() -> None:
    """An eval row's token count without its token list (a 20 MB row made 3 million strings):
    the same count and emptiness as the tokens themselves, on texts of separators, controls,
    non-ASCII whitespace, NFD accents and case that lowering changes."""
    import random

    from refinery.transforms.decon.ngrams.normalized import token_count, tokens
    from refinery.transforms.decon.ngrams.word_split import get_tokenizer

    rng = random.Random(46)
    alphabet = ["a", "B", "z", " ", "  ", ".", ",", "\n", "\t", "\r\n", "\x85", "\x9f", "\u00a0", "\u3000",
                "e\u0301", "\u0130", "\u200b", "\uff21", "ß", "?!", "'"]
    for name in ("default", "no_lowercase", "whitespace"):
        tok = get_tokenizer(name)
        for _ in range(3000):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            got = tokens(tok, text)
            assert token_count(tok, text) == (len(got), not any(got)), (name, text)
