"""Tests of refinery.transforms.decon.report_html: the page parsed with the standard library's parser."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from html.parser import HTMLParser
from typing import Any

import pytest

from refinery.transforms.decon import report_html as rh
from refinery.transforms.decon.report_html import (
    ContaminationReport,
    DatasetReport,
    Example,
    NgramCount,
    NResult,
    Span,
    TrainFileCount,
    TrainHit,
    render_html,
)

HOSTILE = '<script>alert(1)</script></div></mark>"&'
VOID = {"meta", "link", "br", "hr", "img", "input", "col", "source", "wbr"}


# ---------------------------------------------------------------------------------------
# A small DOM from html.parser
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Node:
    tag: str
    attrs: dict[str, str]  # a valueless attribute (<x hidden>) reads as ""
    children: list[str | Node] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if c.tag == tag and (cls is None or cls in c.classes()):
                    out.append(c)
                out += c.find_all(tag, cls)
        return out


class Page(HTMLParser):
    """Parses a page into a :class:`Node` tree and counts opened/closed tags."""

    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]
        self.opened: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self.errors: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        self.opened[tag] += 1
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        self.closed[tag] += 1
        if self.stack[-1].tag != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1].tag}>")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(page: str) -> Page:
    p = Page(page)
    assert p.errors == [], p.errors[:5]
    assert len(p.stack) == 1, [n.tag for n in p.stack]
    return p


def marks(block: Node) -> list[str]:
    return [m.text() for m in block.find_all("mark")]


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------

def result(n: int, instances: int, contaminated: int, **evidence: Any) -> NResult:
    share = contaminated / instances if instances else 0.0
    return NResult(n, instances, contaminated, share, share / 2, share / 3, share / 4, share / 5, **evidence)


def dataset(name: str, instances: int, per_n: dict[int, int], examples: Iterable[Example] = (),
            top: Iterable[tuple[str, int]] = (), paths: tuple[str, ...] | None = None) -> DatasetReport:
    """A dataset with ``examples`` and ``top`` (training path, instances) files at its smallest n."""
    first = min(per_n, default=None)
    evidence = dict(examples=tuple(examples), top_train_files=tuple(TrainFileCount(p, c, c) for p, c in top))
    return DatasetReport(name=name, eval_paths=paths if paths is not None else (f"eval/{name}/test.jsonl",),
                         num_rows=instances, num_instances=instances, num_empty_instances=0, num_bad_rows=0,
                         results=tuple(result(n, instances, c, **(evidence if n == first else {}))
                                       for n, c in sorted(per_n.items())))


def report(*datasets: DatasetReport, **kw: Any) -> ContaminationReport:
    base: dict[str, Any] = dict(title="Train/test overlap", settings=(("n", "8, 13"), ("tokenizer", "default"),
                                                      ("max-train-count", "none")),
                inputs=(("eval", "eval/gsm8k/test.jsonl", "size 1234, version 1700000000.5"),
                        ("train", "gs://bucket/train-00000.jsonl.zst", "size 99, version 1700000001.0")),
                rows_read=(("eval rows", 1319), ("training rows", 7473)), datasets=tuple(datasets),
                generated_by="refinery decon 0.1.0")
    base.update(kw)
    return ContaminationReport(**base)


def example(text: str, spans: list[tuple[int, int]], hits: Iterable[TrainHit] = (), instance_id: str = "i-1",
            row: int = 0, overlap: float = 0.5) -> Example:
    return Example(instance_id, row, text, tuple(Span(s, e) for s, e in spans), overlap, tuple(hits))


def hit(snippet: str, spans: list[tuple[int, int]], path: str = "train/part-0.jsonl", row: int = 7,
        ngrams: int = 3) -> TrainHit:
    return TrainHit(path, row, snippet, tuple(Span(s, e) for s, e in spans), ngrams)


# ---------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spans,length,expected", [
    ([], 10, []),
    ([(2, 4)], 10, [(2, 4)]),
    ([(5, 8), (2, 4)], 10, [(2, 4), (5, 8)]),           # sorted
    ([(2, 5), (4, 8)], 10, [(2, 8)]),                   # overlapping
    ([(2, 4), (4, 6)], 10, [(2, 6)]),                   # adjacent
    ([(2, 9), (3, 4)], 10, [(2, 9)]),                   # contained
    ([(3, 3), (5, 4)], 10, []),                         # empty, reversed
    ([(-5, 2), (8, 50), (12, 20)], 10, [(0, 2), (8, 10)]),   # clamped; beyond the text dropped
])
def test_merge_spans(spans: list[tuple[int, int]], length: int, expected: list[tuple[int, int]]) -> None:
    assert rh.merge_spans([Span(s, e) for s, e in spans], length) == expected


@pytest.mark.parametrize("part,total,expected", [
    (37, 1319, "2.81%"), (0, 10, "0%"), (10, 10, "100%"), (0, 0, "n/a"), (5, 0, "n/a"), (1, 3, "33.33%"),
    (1, 4, "25.0%"), (1, 100_000, "<0.01%"), (99_999, 100_000, ">99.99%"), (1, 8, "12.5%"),
])
def test_percent(part: int, total: int, expected: str) -> None:
    assert rh.percent(part, total) == expected


def test_text_window() -> None:
    assert rh.text_window(100, [(10, 20)], 200) == (0, 100)
    assert rh.text_window(10_000, [], 3000) == (0, 3000)
    start, end = rh.text_window(10_000, [(5000, 5100)], 3000)
    assert end - start == 3000 and start < 5000 and 5100 < end          # centred on the spans
    assert rh.text_window(10_000, [(9900, 9990)], 3000) == (7000, 10_000)
    start, end = rh.text_window(50_000, [(1000, 1010), (40_000, 40_010)], 3000)
    assert (start, end) == (1000 - rh.CONTEXT_CHARS, 1000 - rh.CONTEXT_CHARS + 3000)


# ---------------------------------------------------------------------------------------
# Structure
# ---------------------------------------------------------------------------------------

def test_every_dataset_and_n_with_counts_and_bars() -> None:
    gsm = dataset("gsm8k", 1319, {8: 37, 13: 20}, top=[("gs://b/t-1.jsonl", 30), ("gs://b/t-2.jsonl", 7)])
    mmlu = dataset("mmlu", 14_042, {8: 1, 13: 0})
    page = render_html(report(gsm, mmlu))
    p = parse(page)
    cards = p.root.find_all("section", "card")
    assert [c.find_all("h3")[0].text() for c in cards] == ["gsm8k", "mmlu"]
    for card, ds in zip(cards, (gsm, mmlu)):
        rows = [tr for tr in card.find_all("tr") if "data-n" in tr.attrs]
        assert [int(tr.attrs["data-n"]) for tr in rows] == [r.n for r in ds.results]
        for tr, r in zip(rows, ds.results):
            assert int(tr.attrs["data-contaminated"]) == r.contaminated
            assert int(tr.attrs["data-instances"]) == r.num_instances
            count = tr.find_all("span", "count")[0].text()
            pct = rh.percent(r.contaminated, r.num_instances)
            assert count == f"{r.contaminated:,} / {r.num_instances:,} instances, {pct}"
            track, = tr.find_all("rect", "track")
            fill, = tr.find_all("rect", "fill")
            full = float(track.attrs["width"])
            width = float(fill.attrs["width"])
            share = r.contaminated / r.num_instances
            assert width == pytest.approx(max(share * full, 1.0) if r.contaminated else 0.0, abs=0.006)
            cells = [td.text() for td in tr.find_all("td")][2:]
            assert cells == [f"{v:.4f}" for v in (r.binary, r.jaccard, r.token, r.jaccard_weighted, r.token_weighted)]
    assert "37 / 1,319 instances, 2.81%" in page
    assert "1 / 14,042 instances, <0.01%" in page
    files = p.root.find_all("section", "evidence")[0].find_all("table", "files")[0]
    assert [[td.text() for td in tr.find_all("td")] for tr in files.find_all("tr")[1:]] == \
        [["gs://b/t-1.jsonl", "30", "30"], ["gs://b/t-2.jsonl", "7", "7"]]
    lede = p.root.find_all("p", "lede")[0].text()
    assert "Contamination found in 2 of 2 eval datasets" in lede


def test_top_files_capped() -> None:
    top = [(f"train/{i:03d}.jsonl", 100 - i) for i in range(25)]
    page = render_html(report(dataset("d", 100, {13: 50}, top=top)))
    files = parse(page).root.find_all("table", "files")[0]
    assert len(files.find_all("tr")) - 1 == rh.MAX_TOP_FILES
    assert "and 15 more training files at n = 13." in page


def test_settings_inputs_and_rows_read() -> None:
    inputs = tuple(("train", f"gs://b/train-{i:05d}.jsonl.zst", f"size {i}, version 1.5") for i in range(120))
    r = report(dataset("d", 3, {13: 1}), inputs=(("eval", "eval/d/test.jsonl", "size 5, version 2.0"),) + inputs)
    p = parse(render_html(r))
    settings, = [s for s in p.root.find_all("section") if s.attrs.get("id") == "settings"]
    kv = [[c.text() for c in tr.children if isinstance(c, Node)] for tr in settings.find_all("tr")]
    assert ["n", "8, 13"] in kv and ["tokenizer", "default"] in kv and ["max-train-count", "none"] in kv
    assert ["eval rows", "1,319"] in kv and ["training rows", "7,473"] in kv
    assert ["eval", "eval/d/test.jsonl", "size 5, version 2.0"] in kv
    assert ["train", "gs://b/train-00049.jsonl.zst", "size 49, version 1.5"] in kv
    assert ["train", "gs://b/train-00050.jsonl.zst", "size 50, version 1.5"] not in kv
    assert "70 more train inputs not listed." in settings.text()


# ---------------------------------------------------------------------------------------
# Highlighting
# ---------------------------------------------------------------------------------------

def test_marks_equal_merged_spans_with_non_ascii() -> None:
    text = "Café au lait coûte 3 € — 中文的句子在这里 😀👍🏽 and the end, é."
    spans = [(0, 4), (2, 8), (19, 22), (25, 31), (31, 32), (34, 37), (45, 500), (9, 9)]
    snippet = "…prefix 中文的句子 😀👍🏽 Café au lait suffix…"
    snippet_spans = [(8, 11), (10, 13), (14, 17), (18, 22), (30, 30)]
    ex = example(text, spans, [hit(snippet, snippet_spans)])
    page = render_html(report(dataset("d", 10, {13: 1}, examples=[ex])))
    p = parse(page)
    block, = p.root.find_all("div", "text")[:1]
    expected = [text[s:e] for s, e in rh.merge_spans([Span(s, e) for s, e in spans], len(text))]
    assert marks(block) == expected
    assert expected == ["Café au ", "3 €", "中文的句子在这", "😀👍🏽", " end, é."]
    assert block.text() == text
    snip, = p.root.find_all("div", "snippet")
    merged = rh.merge_spans([Span(s, e) for s, e in snippet_spans], len(snippet))
    assert marks(snip) == [snippet[s:e] for s, e in merged]
    assert marks(snip) == ["中文的句子", "😀👍🏽", "Café"]
    assert snip.text() == snippet
    assert "5 highlighted spans" in page


def test_long_text_shows_a_window_around_the_spans() -> None:
    text = "".join(f"w{i:05d} " for i in range(7000))              # 49,000 characters
    spans = [(30_000, 30_014), (30_007, 30_030), (30_500, 30_520), (45_000, 45_010), (100, 110)]
    page = render_html(report(dataset("d", 10, {13: 1}, examples=[example(text, spans)])))
    block = parse(page).root.find_all("div", "text")[0]
    merged = rh.merge_spans([Span(s, e) for s, e in spans], len(text))
    start, end = rh.text_window(len(text), merged, rh.MAX_TEXT_CHARS)
    assert end - start == rh.MAX_TEXT_CHARS
    inside = [text[max(s, start):min(e, end)] for s, e in merged if e > start and s < end]
    assert marks(block) == inside and inside
    assert start == 0                                     # the span near the start pulls the window there
    assert text[end - 1] != " " != text[end]              # the window ends inside a word ...
    end = text.rindex(" ", 0, end)                        # ... which the page leaves out
    assert block.text() == text[start:end] + " …" and block.text().endswith("w00427 …")
    assert f"Showing characters {start + 1:,}–{end:,} of {len(text):,}" in page
    assert "highlighted spans outside this window not shown" in page


def test_snippet_is_capped() -> None:
    snippet = "x" * 5000
    ex = example("abc", [(0, 3)], [hit(snippet, [(2500, 2510)])])
    page = render_html(report(dataset("d", 10, {13: 1}, examples=[ex])))
    snip, = parse(page).root.find_all("div", "snippet")
    assert len(snip.text()) == rh.MAX_SNIPPET_CHARS + 4
    assert marks(snip) == ["x" * 10]


def test_hits_capped_and_missing() -> None:
    hits = [hit("abc", [(0, 1)], row=i) for i in range(4)]
    page = render_html(report(dataset("d", 10, {13: 2}, examples=[example("abc", [(0, 3)], hits),
                                                                  example("def", [(0, 3)], [], instance_id="i-2")])))
    p = parse(page)
    assert len(p.root.find_all("div", "hit")) == rh.MAX_HITS
    assert "2 more training hits not shown." in page
    assert "No training hit was recorded for this instance." in page


# ---------------------------------------------------------------------------------------
# Escaping and self-containment
# ---------------------------------------------------------------------------------------

def hostile_report() -> ContaminationReport:
    text = f"Question {HOSTILE} then more {HOSTILE} end"
    i = text.index(HOSTILE)
    spans = [(i, i + 8), (i + 5, i + len(HOSTILE)), (text.rindex("</mark>"), text.rindex("</mark>") + 7)]
    snippet = f"train {HOSTILE} tail"
    j = snippet.index(HOSTILE)
    ex = example(text, spans, [hit(snippet, [(j, j + len(HOSTILE))], path=f"gs://b/{HOSTILE}.jsonl")],
                 instance_id=HOSTILE)
    ds = dataset(f"name {HOSTILE}", 10, {13: 1}, examples=[ex], top=[(f"train/{HOSTILE}", 1)],
                 paths=(f"eval/{HOSTILE}/test.jsonl",))
    return report(ds, title=f"Title {HOSTILE}", generated_by=f"gen {HOSTILE}",
                  settings=((f"k {HOSTILE}", f"v {HOSTILE}"),), inputs=(("eval", f"p {HOSTILE}", f"f {HOSTILE}"),),
                  rows_read=((f"rows {HOSTILE}", 1),))


def test_hostile_texts_are_escaped() -> None:
    r = hostile_report()
    page = render_html(r)
    p = parse(page)
    assert p.opened["script"] == 0 and "<script" not in page.lower()
    for tag in ("div", "mark", "section", "article", "p", "table", "code", "span"):
        assert p.opened[tag] == p.closed[tag], tag
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&lt;/div&gt;&lt;/mark&gt;&quot;&amp;"
    assert page.count(escaped) >= 15
    assert HOSTILE not in page
    ex = r.datasets[0].results[0].examples[0]
    block = p.root.find_all("div", "text")[0]
    assert block.text() == ex.text
    assert marks(block) == [ex.text[s:e] for s, e in rh.merge_spans(ex.spans, len(ex.text))]
    snip, = p.root.find_all("div", "snippet")
    assert marks(snip) == [HOSTILE]
    assert p.root.find_all("h3")[0].text() == f"name {HOSTILE}"
    assert p.root.find_all("title")[0].text() == f"Title {HOSTILE}"
    assert p.root.find_all("meta")[2].attrs["content"] == f"gen {HOSTILE}"


def test_controls_and_lone_surrogates_keep_offsets_and_encode() -> None:
    text = "a\x00b\x1bc\ud800d\te\nf"
    page = render_html(report(dataset("d", 1, {13: 1}, examples=[example(text, [(1, 4), (5, 6)])])))
    page.encode("utf-8")
    block = parse(page).root.find_all("div", "text")[0]
    assert marks(block) == ["\ufffdb\ufffd", "?"]
    assert block.text() == "a\ufffdb\ufffdc?d\te\nf"


def test_no_external_resources() -> None:
    for page in (render_html(hostile_report()), render_html(dense_report(datasets=1, examples=5))):
        low = page.lower()
        assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", low)
        for banned in ("<link", "<script", "@import", "url(", "<img", "<iframe", "<object", "<embed"):
            assert banned not in low, banned
        hrefs = [n.attrs["href"] for n in parse(page).root.find_all("a")]
        assert hrefs and all(h.startswith("#") for h in hrefs)


def test_untrusted_strings_are_isolated_from_the_text_around_them() -> None:
    rlo = "\u202e"          # RIGHT-TO-LEFT OVERRIDE: reverses what follows it, up to the end of its isolate
    ex = example("the sum of two", [(4, 7)], [hit("the sum of two", [(4, 7)], path=f"train/{rlo}evil.jsonl")],
                 instance_id=f"id{rlo}1")
    ds = dataset(f"gsm{rlo}8k", 10, {13: 1}, examples=[ex], top=[(f"train/{rlo}evil.jsonl", 1)],
                 paths=(f"eval/{rlo}x/test.jsonl",))
    r = report(ds, settings=((f"k{rlo}", f"v{rlo}"),), inputs=(("eval", f"p{rlo}", f"f{rlo}"),),
               rows_read=((f"rows{rlo}", 1),), generated_by=f"gen{rlo}")
    page = render_html(r)
    assert "bdi{unicode-bidi:isolate}" in page

    def unisolated(node: Node, inside: bool = False) -> list[str]:
        inside = inside or node.tag == "bdi"
        out = []
        for c in node.children:
            if isinstance(c, str):
                out += [c] if rlo in c and not inside else []
            else:
                out += unisolated(c, inside)
        return out

    body = parse(page).root.find_all("body")[0]
    assert body.text().count(rlo) == 13 and unisolated(body) == []      # the name: in its card, section, at n


def test_tables_scroll_inside_their_card_and_the_metrics_cells_carry_their_labels() -> None:
    # a narrow screen (420 px) must not cut a column: every table sits in a scrolling wrapper,
    # and each metrics cell names its column and n (data-label), so the rows can stack
    page = render_html(report(dataset("gsm8k", 1319, {5: 380, 9: 3, 13: 2}, top=[("t.jsonl", 2)]),
                              dataset("d", 10, {5: 0, 9: 0, 13: 0})))
    p = parse(page)
    tables = p.root.find_all("table")
    assert tables and all(any(t is c for sc in p.root.find_all("div", "scroll") for c in sc.children) for t in tables)
    for table in p.root.find_all("table", "metrics"):
        head = [th.text() for th in table.find_all("th")]
        assert head[2:] == ["binary", "jaccard", "token", "jaccard (weighted)", "token (weighted)"]
        for tr in table.find_all("tr")[1:]:
            n = tr.attrs["data-n"]
            labels = [td.attrs.get("data-label", "") for td in tr.find_all("td")]
            assert labels[0] == "n" and len(labels) == len(head)
            assert all(lab == f"{h} at n = {n}" for lab, h in zip(labels[1:], head[1:]))


def test_fingerprints_read_as_sizes_and_dates() -> None:
    assert rh.fingerprint_text(241537, "1700000000.5", remote=False) == \
        "size 241,537 bytes, modified 2023-11-14 22:13:20 UTC"
    assert rh.fingerprint_text(99, "1712345678901234", remote=True) == "size 99 bytes, generation 1712345678901234"
    assert rh.fingerprint_text(99, "2024-05-01T00:00:00Z", remote=True) == "size 99 bytes, version 2024-05-01T00:00:00Z"
    assert rh.fingerprint_text(5, "not a time", remote=False) == "size 5 bytes, version not a time"
    assert rh.fingerprint_text(5, "", remote=False) == "size 5 bytes"


def test_rows_are_shown_as_numbered_in_the_stats_files() -> None:
    ex = example("abc", [(0, 3)], [hit("abc", [(0, 3)], row=0)], row=0)
    p = parse(render_html(report(dataset("d", 10, {13: 1}, examples=[ex]))))
    art, = p.root.find_all("article", "example")
    meta, hit_meta = (m.text() for m in art.find_all("p", "meta"))
    assert "· eval row 0 ·" in meta and "· row 0 ·" in hit_meta      # a file's first row is row 0, as given


def test_snippets_start_and_end_on_whole_words() -> None:
    snippet = "ousand words of context: the sum of two and three, said the teac"
    s = snippet.index("the sum")
    cut = TrainHit("t.jsonl", 1, snippet, (Span(s, s + 7),), 1, cut_before=True, cut_after=True)
    whole = TrainHit("t.jsonl", 2, snippet, (Span(s, s + 7),), 1)
    page = render_html(report(dataset("d", 10, {13: 1}, examples=[example("abc", [(0, 3)], [cut, whole])])))
    first, second = parse(page).root.find_all("div", "snippet")
    assert first.text() == "… words of context: the sum of two and three, said the …"
    assert second.text() == snippet                                   # not cut: shown as it is
    # never into a highlight, and a word longer than WORD_SLACK stays cut
    assert rh.word_bounds("abc def", [(1, 3)], 0, 7, True, False) == (0, 7)
    long_word = "x" * (rh.WORD_SLACK + 5) + " tail"
    assert rh.word_bounds(long_word, [], 0, len(long_word), True, False) == (0, len(long_word))
    assert rh.word_bounds("ab cd ef", [], 0, 8, True, True) == (3, 5)
    assert rh.word_bounds(" and his", [], 0, 8, True, False) == (1, 8)      # no blank after the ellipsis


def test_an_example_says_how_many_instances_share_its_text() -> None:
    ex = Example("i-1", 0, "abc", (Span(0, 3),), 1.0, (), same_text=49_999)
    page = render_html(report(dataset("d", 50_000, {13: 50_000}, examples=[ex])))
    meta = parse(page).root.find_all("article", "example")[0].find_all("p", "meta")[0].text()
    assert meta.endswith("· 49,999 other instances with exactly this text")


# ---------------------------------------------------------------------------------------
# A section per n
# ---------------------------------------------------------------------------------------

def per_n_report() -> ContaminationReport:
    """GSM8K-like: many instances overlap at n = 5 through boilerplate, few at 9 and 13."""
    def at(n: int, contaminated: int, rows: int, files: list[tuple[str, int, int]], grams: list[tuple[str, int, int]],
           texts: list[str]) -> NResult:
        exs = tuple(example(t, [(0, 7)], [hit(t, [(0, 7)], row=100 + i)], instance_id=f"n{n}-{i}", row=i)
                    for i, t in enumerate(texts))
        return result(n, 1319, contaminated, train_rows=rows,
                      top_train_files=tuple(TrainFileCount(p, c, r) for p, c, r in files),
                      top_ngrams=tuple(NgramCount(g, c, r) for g, c, r in grams), examples=exs)

    boiler = [(f"the total amount of money {k}", 40 - k, 90 - k) for k in range(rh.MAX_TOP_NGRAMS + 5)]
    return report(DatasetReport("gsm8k", ("eval/gsm8k/test.jsonl",), 1319, 1319, 0, 0, (
        at(5, 380, 228, [("train/a.jsonl", 292, 150), ("train/b.jsonl", 218, 78)], boiler,
           ["at the end of the day", "the total amount"]),
        at(9, 3, 3, [("train/a.jsonl", 2, 2), ("train/b.jsonl", 1, 1)],
           [("bought stamps at the post office some of the", 1, 1)], ["bought stamps here"]),
        at(13, 2, 2, [("train/b.jsonl", 2, 2)], [("a 13 gram", 2, 2)], ["bought stamps there"]))))


def test_a_section_per_n_with_its_own_counts_files_n_grams_and_examples() -> None:
    r = per_n_report()
    p = parse(render_html(r))
    ds = r.datasets[0]
    evidence, = p.root.find_all("section", "evidence")
    sections = evidence.find_all("section", "at-n")
    assert [int(sec.attrs["data-n"]) for sec in sections] == [5, 9, 13]
    # the card links to each of them
    card, = p.root.find_all("section", "card")
    assert [a.attrs["href"] for a in card.find_all("a")] == [f"#{sec.attrs['id']}" for sec in sections]
    for sec, res in zip(sections, ds.results):
        n = f"n = {res.n}"
        assert sec.find_all("h4")[0].text() == f"gsm8k at {n}"
        counts = sec.find_all("p", "counts")[0].text()
        assert n in counts and f"{res.contaminated:,} of 1,319 instances" in counts
        assert f"{res.train_rows:,} training row" in counts
        # every count column names its n
        files, = sec.find_all("table", "files")
        assert [th.text() for th in files.find_all("th")][1:] == [f"instances at {n}", f"training rows at {n}"]
        assert [[td.text() for td in tr.find_all("td")] for tr in files.find_all("tr")[1:]] == \
            [[f.path, f"{f.instances:,}", f"{f.train_rows:,}"] for f in res.top_train_files]
        grams, = sec.find_all("table", "ngrams")
        assert [th.text() for th in grams.find_all("th")][1] == f"instances at {n}"
        got = [[td.text() for td in tr.find_all("td")] for tr in grams.find_all("tr")[1:]]
        assert got == [[g.ngram, f"{g.instances:,}", f"{g.train_rows:,}"]
                       for g in res.top_ngrams[:rh.MAX_TOP_NGRAMS]]                  # bounded
        ids = [a.find_all("code")[0].text() for a in sec.find_all("article", "example")]
        assert ids == [e.instance_id for e in res.examples] and all(i.startswith(f"n{res.n}-") for i in ids)
    assert len(sections[0].find_all("table", "ngrams")[0].find_all("tr")) - 1 == rh.MAX_TOP_NGRAMS


def test_an_n_without_overlaps_says_so_in_its_section() -> None:
    p = parse(render_html(report(dataset("d", 10, {5: 4, 13: 0}, examples=[example("abc", [(0, 3)])]))))
    five, thirteen = p.root.find_all("section", "at-n")
    assert five.find_all("article", "example") and not thirteen.find_all("article", "example")
    assert thirteen.find_all("p", "clean") and "n = 13" in thirteen.find_all("p", "clean")[0].text()
    assert not thirteen.find_all("table")


# ---------------------------------------------------------------------------------------
# Size bound
# ---------------------------------------------------------------------------------------

def dense_report(datasets: int = 3, examples: int = 200, text_chars: int = 50_000) -> ContaminationReport:
    unit = 'x < y & "z" 中文 😀 '                          # escapes and multi-byte characters
    text = (unit * (text_chars // len(unit) + 1))[:text_chars]
    spans = tuple(Span(s, s + 40) for s in range(0, text_chars, 97))    # ~500 spans
    snippet = text[:400]
    snippet_spans = tuple(Span(s, s + 30) for s in range(0, 400, 50))
    out = []
    for d in range(datasets):
        exs = tuple(Example(f"ds{d}-{i}", i, text, spans, 1.0 - i / 1000,
                            (TrainHit(f"gs://b/train-{i:05d}.jsonl.zst", i * 3, snippet, snippet_spans, 40),
                             TrainHit(f"gs://b/train-{i + 1:05d}.jsonl.zst", i * 5, snippet, snippet_spans, 12)))
                    for i in range(examples))
        files = tuple(TrainFileCount(f"gs://b/train-{i:05d}.jsonl.zst", 500 - i, 600 - i) for i in range(40))
        grams = tuple(NgramCount(f"a frequent {k} n-gram", 400 - k, 900 - k) for k in range(30))
        out.append(DatasetReport(f"eval-{d}", (f"eval/eval-{d}/test.jsonl",), 5000, 5000, 3, 1,
                                 tuple(result(n, 5000, 5000 // n, train_rows=999, top_train_files=files,
                                              top_ngrams=grams, examples=exs if n == 8 else ())
                                       for n in (8, 13, 20))))
    return report(*out)


def test_size_bound_on_hit_dense_input() -> None:
    r = dense_report()
    page = render_html(r)
    size = len(page.encode("utf-8"))
    assert size <= 2_000_000
    assert size > 1_500_000                                  # the budget is used, not wasted
    p = parse(page)
    sections = p.root.find_all("section", "evidence")
    assert len(sections) == 3
    shown = [len(s.find_all("article", "example")) for s in sections]
    assert all(k > 0 for k in shown) and max(shown) - min(shown) <= 1      # round robin: fair
    for s, k in zip(sections, shown):
        ids = [a.find_all("code")[0].text() for a in s.find_all("article", "example")]
        assert ids == [f"{s.find_all('h3')[0].text().replace('eval-', 'ds')}-{i}" for i in range(k)]   # a prefix
        assert f"Showing the first {k:,} of 200 examples at n = 8; {200 - k:,} omitted" in s.text()
    for block in p.root.find_all("div", "text"):
        assert len(block.text()) <= rh.MAX_TEXT_CHARS + 4


@pytest.mark.parametrize("max_bytes", [60_000, 250_000, 1_000_000])
def test_size_bound_other_budgets(max_bytes: int) -> None:
    page = render_html(dense_report(datasets=3, examples=40, text_chars=20_000), max_bytes=max_bytes)
    assert len(page.encode("utf-8")) <= max_bytes
    parse(page)
    assert "omitted to keep this page within" in page


def test_size_bound_with_many_datasets() -> None:
    many = [dataset(f"eval-{i:04d}", 100, {8: 3, 13: 1}, top=[(f"train/{k}.jsonl", 3) for k in range(10)])
            for i in range(2000)]
    page = render_html(report(*many), max_bytes=300_000)
    assert len(page.encode("utf-8")) <= 300_000
    p = parse(page)
    cards = p.root.find_all("section", "card")
    assert 0 < len(cards) < 2000
    assert f"{2000 - len(cards):,} more eval datasets not shown" in page


def test_tiny_budget_gives_a_notice_page() -> None:
    settings = tuple((f"setting {i}", "v" * 300) for i in range(200))
    page = render_html(report(dataset("d", 1, {13: 1}), settings=settings), max_bytes=rh.MIN_MAX_BYTES)
    assert len(page.encode("utf-8")) <= rh.MIN_MAX_BYTES
    parse(page)
    assert "does not fit in 16,384 bytes" in page
    with pytest.raises(ValueError):
        render_html(report(), max_bytes=rh.MIN_MAX_BYTES - 1)


# ---------------------------------------------------------------------------------------
# Empty states
# ---------------------------------------------------------------------------------------

def test_no_eval_datasets() -> None:
    page = render_html(report())
    p = parse(page)
    assert "No eval datasets were read, so there is nothing to compare." in page
    assert p.root.find_all("section", "card") == []


def test_no_contamination() -> None:
    page = render_html(report(dataset("gsm8k", 1319, {8: 0, 13: 0}), dataset("mmlu", 50, {13: 0})))
    p = parse(page)
    lede = p.root.find_all("p", "lede")[0].text()
    assert lede.startswith("No contamination found: none of the 1,369 eval instances in 2 eval datasets")
    assert page.count("No instance overlaps the training data, so there is nothing to show.") == 2
    assert p.root.find_all("mark") == []
    assert [float(f.attrs["width"]) for f in p.root.find_all("rect", "fill")] == [0.0, 0.0, 0.0]
    assert "0 / 1,319 instances, 0%" in page


def test_dataset_with_no_instances() -> None:
    empty = DatasetReport("empty", (), 0, 0, 0, 0, (result(8, 0, 0), result(13, 0, 0)))
    page = render_html(report(empty, dataset("gsm8k", 10, {8: 2, 13: 1})))
    p = parse(page)
    assert "This eval set has no instances, so there is nothing to measure." in page
    assert "This eval set has no instances, so there is nothing to show." in page
    card = p.root.find_all("section", "card")[0]
    assert [s.text() for s in card.find_all("span", "count")] == ["0 / 0 instances, n/a"] * 2
    assert [td.text() for td in card.find_all("td")][2:7] == ["n/a"] * 5
    assert "Contamination found in 1 of 2 eval datasets" in page
    only_empty = render_html(report(empty))
    assert "The eval datasets have no instances, so there is nothing to measure." in only_empty


def test_contaminated_dataset_without_examples() -> None:
    page = render_html(report(dataset("d", 10, {13: 4})))
    assert "No examples were selected for this report." in page


# ---------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------

RENDER_TWICE = """
import hashlib, sys
sys.path.insert(0, {tests!r})
import test_decon_report_html as t
from refinery.transforms.decon.report_html import render_html
for page in (render_html(t.dense_report(datasets=2, examples=30, text_chars=8000), max_bytes=200_000),
             render_html(t.hostile_report()), render_html(t.per_n_report())):
    print(hashlib.sha256(page.encode("utf-8")).hexdigest())
"""


def test_deterministic_whatever_the_hash_seed() -> None:
    # in subprocesses: one process has one hash seed, so rendering twice in it cannot catch an
    # order that depends on set or dict-of-str hashing
    code = RENDER_TWICE.format(tests=os.path.dirname(os.path.abspath(__file__)))
    digests = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2")]
    assert digests[0] == digests[1] and len(digests[0].split()) == 3
