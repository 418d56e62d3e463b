"""One normalization that is its own fixed point (issue 58, item 3).

``normalize_text`` used to apply NFC, then drop controls: ``"e\\x81\\u0301"`` became
``"e\\u0301"``, which is not NFC (a second pass gives ``"é"``), so decon missed a training
row ``The\\x81\\u0301o ...`` against the eval's ``Théo ...`` while prep trained on text
canonically equal to the question (5 of 6 accented questions leaked). Now the controls go
first, then NFC, then the strip: ``normalize(normalize(t)) == normalize(t)`` for every
string (a seeded property test over generated strings), the offset map stays exact, decon
lists such rows, prep drops them, and a drop list of the older rule is refused.
"""
from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from helpers import run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.io.text import TEXT_NORMALIZATION, normalize_text, normalized_offsets, raw_spans

DROPPED = [chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in "\t\n\r"]
MARKS = ["\u0301", "\u0300", "\u0302", "\u0308", "\u0316", "\u0323", "\u0327", "\u0328", "\u0338", "\u0344",
         "\u0345", "\u0f71", "\u0f72", "\u0f73", "\u05b0", "\u1dce", "\u302a", "\u3099", "\U0001d165"]
JAMO = ["\u1100", "\u1112", "\u1161", "\u1175", "\u11a8", "\u11c2", "\u11ff", "\ud7b0", "\ud7cb", "\uac00", "\uac01",
        "\ud7a3", "\u3131"]
STARTERS = ["a", "e", "A", "o", "u", "E", "\u00e9", "\u212b", "\u0958", "\u2126", "\u0b47", "\u0b3e", "\u0dd9",
            "\u0dcf", "\u1025", "\u102e", "\u00a8", "\ufb01", "\uff21", "\u1e9b"]
SPACE = [chr(c) for c in range(0x3100) if chr(c).isspace()] + ["\r\n", "\r", "\t", "\n"]


def definition(text: str) -> str:
    """The rule, step by step: CR LF and CR to LF; every Cc but TAB and LF dropped; NFC; strip."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "".join(c for c in text if unicodedata.category(c) != "Cc" or c in "\t\n")
    return unicodedata.normalize("NFC", text).strip()


def _any_plane(rnd: random.Random, surrogates: bool) -> str:
    plane = rnd.randrange(17)
    cp = rnd.randrange(plane << 16, (plane + 1) << 16)
    if 0xD800 <= cp < 0xE000 and not surrogates:
        cp -= 0x1000
    return chr(cp)


def generated(seed: int, count: int, surrogates: bool = True, length: int = 24) -> list[str]:
    """Strings of combining marks, Hangul jamo (L, V, T, syllables), every control (C0, DEL,
    C1, CR), whitespace, starters that compose and code points of every plane (lone
    surrogates too: a JSON reader hands them to decon), in every order and position."""
    rnd = random.Random(seed)
    kinds = [MARKS, JAMO, STARTERS, SPACE, DROPPED, list("xyz .,")]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rnd.randrange(length)):
            k = rnd.randrange(len(kinds) + 1)
            parts.append(_any_plane(rnd, surrogates) if k == len(kinds) else rnd.choice(kinds[k]))
        out.append("".join(parts))
    return out


def test_normalize_text_is_its_own_fixed_point() -> None:
    # before: 'e\x81\u0301' -> 'e\u0301' -> 'é' (a second pass changed it); here ~0.3% of such strings
    texts = generated(58, 6000)
    changed = 0
    for t in texts:
        once = normalize_text(t)
        assert normalize_text(once) == once, ascii(t)
        assert once == definition(t), ascii(t)
        assert unicodedata.is_normalized("NFC", once) and once == once.strip()
        changed += once != t
    assert changed > 5000  # the strings exercise the rule
    for t in ["e\x81\u0301", "\u1100\x85\u1161\x9f\u11a8", " \u0301x", "\u0301 ", "\x85\u0301", "a\r\u0301"]:
        assert normalize_text(normalize_text(t)) == normalize_text(t), ascii(t)


def test_a_dropped_control_anywhere_is_as_if_it_were_not_there() -> None:
    # before: a control between a base and its mark (or between jamo) kept them apart: "e\x81\u0301" != "é"
    rnd = random.Random(5)
    for t in generated(6, 400, length=10):
        t = t.replace("\r", "")  # (a control between \r and \n makes two line ends: kept apart on purpose)
        want = normalize_text(t)
        for i in range(len(t) + 1):
            c = rnd.choice(DROPPED)
            assert normalize_text(t[:i] + c + t[i:]) == want, (ascii(t), i, ascii(c))


def _check_map(raw: str) -> int:
    """The offset map of ``raw`` gives its normalized text, and every span between the pieces
    NFC normalizes apart maps to raw text whose normalization (but the strip) is that span."""
    norm, start, end = normalized_offsets(raw)
    assert norm == normalize_text(raw), ascii(raw)
    assert len(start) == len(end) == len(norm) and (start < end).all() and (end <= len(raw)).all()
    assert (np.diff(start) >= 0).all() and (np.diff(end) >= 0).all()
    firsts = [s for s in range(len(norm)) if s == 0 or start[s] >= end[s - 1]]
    lasts = [e for e in range(1, len(norm) + 1) if e == len(norm) or end[e - 1] <= start[e]]
    checked = 0
    for s in firsts[:5]:
        for e in [e for e in lasts if e > s][:5]:
            a, b = raw_spans(start, end, np.array([s]), np.array([e]), len(raw))
            piece = raw[int(a[0]):int(b[0])].replace("\r\n", "\n").replace("\r", "\n")
            dropped = "".join(c for c in piece if unicodedata.category(c) != "Cc" or c in "\t\n")
            assert unicodedata.normalize("NFC", dropped) == norm[s:e], (ascii(raw), s, e)
            checked += 1
    return checked


def test_the_offset_map_stays_exact_under_the_new_order() -> None:
    assert sum(_check_map(raw) for raw in generated(7, 1500)) > 10_000
    # a control between a base and its mark: the composed character comes from all three
    norm, start, end = normalized_offsets("The\x81\u0301o")
    assert norm == "Th\u00e9o" and start.tolist() == [0, 1, 2, 5] and end.tolist() == [1, 2, 5, 6]
    # Hangul jamo split by controls: one syllable from the whole run, the controls inside it included
    norm, start, end = normalized_offsets(" \u1100\x85\u1161\x9f\u11a8 x\r\n")
    assert norm == "\uac01 x" and start.tolist() == [1, 6, 7] and end.tolist() == [6, 7, 8]
    # a mark reordered past a control: from the whole run
    norm, start, end = normalized_offsets("a\u0301\x00\u0316b")
    assert norm == "\u00e1\u0316b" and start.tolist() == [0, 0, 4] and end.tolist() == [4, 4, 5]


QUESTIONS = [  # (language, question): each with more than 13 tokens, accents (or syllables) throughout
    ("fr", "Théo a acheté trois baguettes à la boulangerie près de l'église, puis il a mangé la moitié en "
           "rentrant à pied ; combien lui en reste-t-il ?"),
    ("vi", "Người nông dân thu hoạch được mười hai bao lúa mỗi ngày trong suốt một tuần; hỏi ông ấy thu hoạch "
           "được bao nhiêu bao lúa?"),
    ("tr", "Ayşe pazardan üç kilo elma ve iki kilo armut aldı, ardından komşusuna yarım kilo elma verdi; geriye "
           "kaç kilo meyve kaldı?"),
    ("de", "Jürgen fährt jeden Morgen zwölf Kilometer mit dem Fahrrad zur Schule und abends wieder zurück; wie "
           "viele Kilometer fährt er täglich?"),
    ("es", "La señora Núñez compró dieciséis limones en el mercado y usó la mitad para preparar limonada; "
           "¿cuántos limones le quedaron?"),
    ("ko", "민수는 사과 열두 개를 샀고 그중 다섯 개를 친구에게 주었습니다 "
           "그리고 세 개를 더 샀습니다 남은 사과는 몇 개입니까"),
]
CONTROLS = ["\x81", "\x00", "\x9f", "\x7f", "\x1b", "\x85"]


def split_by_controls(text: str) -> str:
    """NFD ``text`` with a control before every combining mark and Hangul vowel or trailing
    consonant: canonically the same text to a reader, once the controls are dropped."""
    out = []
    for i, c in enumerate(unicodedata.normalize("NFD", text)):
        if unicodedata.combining(c) or 0x1160 <= ord(c) < 0x1200:
            out.append(CONTROLS[i % len(CONTROLS)])
        out.append(c)
    return "".join(out)


def _decon(train: Path, evals: Path, out: Path) -> int:
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "13",
                 "--partitions", "2", "--runner", "direct", "--no-progress"])


def _listed(decon: Path) -> list[int]:
    return [json.loads(line)["train_row"]
            for line in (decon / "stats/contaminated_train_docs.jsonl").read_text().splitlines()]


def _shard_texts(output: Path) -> list[str]:
    from refinery.transforms.formats.tiktoken_vocab import get_encoding

    enc, texts = get_encoding(), []
    manifest = json.loads((output / "manifest.json").read_text())
    for s in manifest["shards"]:
        tokens = np.load(output / s["path"])
        ends = np.flatnonzero(tokens == manifest["eos_token_id"])
        for a, b in zip([0, *(ends + 1).tolist()], ends.tolist()):
            texts.append(enc.decode(tokens[a:b].tolist()))
    return texts


FILLER = [f"Row {i} talks about the weather, the harbour and the trains that leave at {i} o'clock."
          for i in range(24)]


def test_decon_lists_questions_split_by_controls_and_prep_leaves_none(tmp_path: Path) -> None:
    # before: decon listed 0 of these 6 rows (exit 0) and prep trained on text canonically equal to each question
    train = [{"id": f"d{i}", "text": t} for i, t in enumerate(FILLER)]
    planted = [3 + 3 * k for k in range(len(QUESTIONS))]
    for at, (_, q) in zip(planted, QUESTIONS):
        train[at]["text"] = f"Some words first. {split_by_controls(q)}\r\nAnd after."
        assert normalize_text(train[at]["text"]) == normalize_text(f"Some words first. {q}\nAnd after.")
    write_jsonl(tmp_path / "corpus" / "train.jsonl", train)
    evals = write_jsonl(tmp_path / "eval" / "accents" / "test.jsonl",
                        [{"id": lang, "text": q} for lang, q in QUESTIONS])
    assert _decon(tmp_path / "corpus", evals, tmp_path / "decon") == 0
    assert _listed(tmp_path / "decon") == planted
    (stats,) = [json.loads(line) for line in (tmp_path / "decon/stats/overlap_stats.jsonl").read_text().splitlines()]
    assert stats["instance_ids"] == sorted(lang for lang, _ in QUESTIONS)
    # the spans decon reports are offsets into the raw row: each covers the planted question, controls and all
    spans = [json.loads(line) for line in (tmp_path / "decon/stats/contaminated_train_spans.jsonl").read_text()
             .splitlines()]
    for entry, (_, q) in zip(spans, QUESTIONS):
        text = train[entry["train_row"]]["text"]
        ((s, e),) = entry["spans"]
        assert normalize_text(text[s:e]) == normalize_text(q).rstrip("? ")
    for mode in (("row",), ("span", "--exclude-window", 0)):
        out = tmp_path / f"prep-{mode[0]}"
        assert run_prep([tmp_path / "corpus"], out, "--num-shards", 2, "--exclude-overlaps", tmp_path / "decon",
                        "--exclude-mode", *mode) == 0
        texts = _shard_texts(out)
        assert not [q for _, q in QUESTIONS if any(q[:40] in t for t in texts)], mode
        write_jsonl(tmp_path / f"shard-{mode[0]}" / "docs.jsonl", [{"text": t} for t in texts])
        assert _decon(tmp_path / f"shard-{mode[0]}", evals, tmp_path / f"decon-{mode[0]}") == 0
        assert _listed(tmp_path / f"decon-{mode[0]}") == [], mode


def test_a_drop_list_of_the_older_normalization_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # before: "nfc-cc-strip-1" was the current version: a drop list of that rule was taken as proof
    assert TEXT_NORMALIZATION != "nfc-cc-strip-1"
    write_jsonl(tmp_path / "corpus" / "train.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(FILLER)])
    evals = write_jsonl(tmp_path / "eval" / "accents" / "test.jsonl", [{"id": "fr", "text": QUESTIONS[0][1]}])
    from refinery.transforms.decon import stages

    monkeypatch.setattr(stages, "TEXT_NORMALIZATION", "nfc-cc-strip-1")  # a decon of the older rule
    assert _decon(tmp_path / "corpus", evals, tmp_path / "decon") == 0
    monkeypatch.undo()
    files = [json.loads(line) for line in (tmp_path / "decon/stats/train_files.jsonl").read_text().splitlines()]
    assert {f["normalization"] for f in files} == {"nfc-cc-strip-1"}
    said = (f"decon read the training text normalized as 'nfc-cc-strip-1'; this prep normalizes it as "
            f"{TEXT_NORMALIZATION!r}: rerun decon with this refinery")
    capsys.readouterr()
    assert run_prep([tmp_path / "corpus"], tmp_path / "out", "--exclude-overlaps", tmp_path / "decon") == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert main(["clean", "--train", str(tmp_path / "corpus"), "--exclude-overlaps", str(tmp_path / "decon"),
                 "--output", str(tmp_path / "clean"), "--runner", "direct", "--no-progress"]) == 2
    assert said in capsys.readouterr().err
