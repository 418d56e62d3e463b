"""``stats/report.html`` of real ``refinery decon`` runs (issue 17), parsed with the standard library's parser."""
from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest
from helpers import gsm8k_rows, write_jsonl
from test_decon_pipeline import (
    helm,
    make_matrix_inputs,
    read_details,
    read_instances,
    read_jsonl,
    run_cli,
    training_texts,
)
from test_decon_report_html import marks, parse

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon import report_html as rh
from refinery.transforms.decon.report_html import plural

HOSTILE_Q = 'What does <script>alert("x")</script></div> print when the page & its "quotes" load twice?'
GIVEN_IDS = {"100005", "p", "q", "s", "arc-1", "h1"}  # the eval rows of make_matrix_inputs (+ hostile) with an id


def shown_id(d: dict[str, Any]) -> str:
    """The id the report shows for the eval row of a detail record (or stats line): its own, or file:row."""
    return d["instance_id"] if d["instance_id"] in GIVEN_IDS else f"{d['eval_path'].rsplit('/', 1)[-1]}:{d['eval_row']}"


def page_of(out: str) -> tuple[str, Any]:  # the page, and test_decon_report_html's Page of it
    page = open(os.path.join(out, "stats/report.html"), encoding="utf-8").read()
    return page, parse(page)


def shown(text: str) -> str:
    """A text as the page shows it (controls and lone surrogates replaced, one for one)."""
    return html.unescape(rh.esc(text))


def merged(offsets: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    return rh.merge_spans([rh.Span(s, e) for s, e in offsets], 1 << 62)


def test_the_page_of_a_run_shows_every_dataset_n_and_the_evidence(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    write_jsonl(tmp_path / "decontamination" / "hostile" / "test.jsonl", [{"id": "h1", "text": HOSTILE_Q}])
    write_jsonl(tmp_path / "train" / "e.jsonl", [{"text": f"A forum post: {HOSTILE_Q} Thanks."}])
    out = str(tmp_path / "out")
    assert run_cli(["--eval", ev, "--train", tr, "--output", out, "--ngrams", "3", "13", "--partitions", "4"]) == 0
    page, p = page_of(out)
    assert p.opened["script"] == 0 and "<script>alert" not in page    # escaped, never a tag

    # every dataset and n, with the counts of overlap_stats.jsonl
    stats = read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))
    cards = p.root.find_all("section", "card")
    assert [c.find_all("h3")[0].text() for c in cards] == ["arc", "gsm8k", "hostile", "mmlu"]
    counts = {(card.find_all("h3")[0].text(), int(tr.attrs["data-n"])): (int(tr.attrs["data-contaminated"]),
                                                                        int(tr.attrs["data-instances"]))
             for card in cards for tr in card.find_all("tr") if "data-n" in tr.attrs}
    assert counts == {(s["eval_dataset"], s["n"]): (len(s["instance_ids"]), s["num_instances"]) for s in stats}

    # the evidence: highlighted spans are the n-gram text at the recorded offsets, in the
    # instance (at the largest n) and in each training snippet
    details = read_details(out)
    instances = read_instances(out)
    train = training_texts(details)
    sections = p.root.find_all("section", "evidence")
    examples = [(sec.find_all("h3")[0].text(), int(at.attrs["data-n"]), art) for sec in sections
                for at in sec.find_all("section", "at-n") for art in at.find_all("article", "example")]
    assert {ds for ds, _, _ in examples} == {"arc", "gsm8k", "hostile", "mmlu"}
    assert {n for _, n, _ in examples} == {3, 13}                      # evidence at every n
    for ds, n, art in examples:
        mine = [d for d in details if d["eval_dataset"] == ds and shown_id(d) == art.find_all("code")[0].text()]
        text = instances[(mine[0]["eval_path"], mine[0]["eval_row"])]["eval_text"]
        n_eff = min(n, len(helm(text)))
        at_n = [d for d in mine if d["n"] == n_eff]
        want = [shown(text[s:e]) for s, e in merged(o for d in at_n for o in d["eval_offsets"])]
        assert marks(art.find_all("div", "text")[0]) == want
        for hit in art.find_all("div", "hit"):
            code = hit.find_all("code")[0].text()
            row = int(hit.find_all("p", "meta")[0].text().split("· row ")[1].split(" ")[0].replace(",", ""))
            occ = merged(o for d in at_n if (d["train_path"], d["train_row"]) == (code, row)
                         for o in d["train_offsets"])
            texts = {shown(train[(code, row)][s:e]) for s, e in occ}
            got = marks(hit.find_all("div", "snippet")[0])
            assert got and set(got) <= texts
    # an eval row without an id is shown by file and row, never by its 20-digit hash
    assert any(d["instance_id"] not in GIVEN_IDS for d in details)
    assert all(d["instance_id"] not in page for d in details if d["instance_id"] not in GIVEN_IDS)
    hostile = [art for ds, _, art in examples if ds == "hostile"][0]
    assert any("<script>alert" in m for m in marks(hostile.find_all("div", "text")[0]))
    assert any("</div>" in m for div in hostile.find_all("div", "snippet") for m in marks(div))

    # settings and rows read, so that a reader can reproduce the run
    kv = {tr.find_all("th")[0].text(): tr.find_all("td")[0].text() for tr in p.root.find_all("tr")
          if tr.find_all("th") and tr.find_all("td") and len(tr.find_all("td")) == 1}
    assert kv["n"] == "3 13" and kv["tokenizer"] == "default" and kv["max-train-count"] == "none"
    summary = read_jsonl(os.path.join(out, "stats/eval_summary.jsonl"))
    assert kv["eval rows"] == f"{sum(s['num_rows'] for s in summary):,}"
    inputs = p.root.find_all("table", "inputs")[0]
    sides = [[td.text() for td in row.find_all("td")] for row in inputs.find_all("tr")[1:]]
    assert {(side, path) for side, path, _ in sides} >= {("eval", f"{ev}/arc-dolma/test.json"),
                                                         ("train", f"{tr}/e.jsonl")}
    local_mtime = r"size [\d,]+ bytes, modified \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
    assert all(re.fullmatch(local_mtime, fp) for _, _, fp in sides)


def test_examples_are_the_most_contaminated_at_each_n_and_capped(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    out = str(tmp_path / "out")
    assert run_cli(["--eval", ev, "--train", tr, "--output", out, "--ngrams", "3", "13", "--partitions", "4",
                    "--report-examples", "1"]) == 0
    _, p = page_of(out)
    metrics = read_jsonl(os.path.join(out, "stats/overlap_metrics.jsonl"))
    for sec in p.root.find_all("section", "evidence"):
        ds = sec.find_all("h3")[0].text()
        for at in sec.find_all("section", "at-n"):
            n = int(at.attrs["data-n"])
            arts = at.find_all("article", "example")
            top = sorted((m for m in metrics if m["eval_dataset"] == ds and m["n"] == n and m["binary"]),
                         key=lambda m: (-m["longest_match"], -m["token"]))  # ConTAM's order, then HELM's
            assert [a.find_all("code")[0].text() for a in arts] == [shown_id(m) for m in top[:1]]
    # report.md shows the same K instances per dataset and n (it showed 5 whatever --report-examples said)
    md = open(os.path.join(out, "stats/report.md"), encoding="utf-8").read()
    tables = [part.split("\n\n")[1] for part in md.split("Longest matches at n = ")[1:]]
    assert tables and all(len(t.splitlines()) == 2 + 1 for t in tables)  # a head, a rule, one instance
    assert max(sum(1 for m in metrics if m["eval_dataset"] == ds and m["n"] == n and m["binary"])
               for ds, n in {(m["eval_dataset"], m["n"]) for m in metrics}) > 1  # where a cap of 1 bites


def test_hit_dense_page_is_small_and_byte_identical_on_rerun(tmp_path: Path) -> None:
    test = gsm8k_rows("test")
    write_jsonl(tmp_path / "eval" / "gsm8k" / "test.jsonl",
                [{"id": f"q{i}", "text": r["question"] + "\n" + r["answer"]} for i, r in enumerate(test)])
    write_jsonl(tmp_path / "train" / "t.jsonl",
                [{"text": r["question"] + "\n" + r["answer"]} for r in gsm8k_rows("train")[:1500]])
    argv = ["--eval", str(tmp_path / "eval"), "--train", str(tmp_path / "train"), "--ngrams", "5",
            "--report-examples", "100000"]
    out = str(tmp_path / "out")
    assert run_cli([*argv, "--output", out]) == 0
    page, p = page_of(out)
    assert len(page.encode("utf-8")) <= 2_000_000
    assert len(p.root.find_all("article", "example")) >= 100       # many examples, yet within the bound
    assert run_cli([*argv, "--output", out, "--force"]) == 0       # everything again, same bytes
    assert open(os.path.join(out, "stats/report.html"), encoding="utf-8").read() == page


def test_written_only_once_the_details_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    out = str(tmp_path / "out")
    argv = ["--eval", ev, "--train", tr, "--output", out, "--ngrams", "3", "13", "--partitions", "4",
            "--details-format", "jsonl"]  # the merge writes the details (Parquet parts: the reduce, before it)
    assert run_cli(argv) == 0
    page = open(os.path.join(out, "stats/report.html"), "rb").read()
    receipt, = [json.load(open(os.path.join(dp, f))) for dp, _, fs in os.walk(os.path.join(out, ".refinery/merge"))
                if dp.endswith("receipts") for f in fs if f.endswith(".json")]
    written = [f["path"] for f in receipt["files"]]
    order = [written.index(f) for f in ("stats/overlap_details.jsonl.gz", "stats/report.html", ".SUCCESS")]
    assert order == sorted(order)

    def broken(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError("merge interrupted")

    # a new plan of the merge (another K) that fails before its page: no page stands beside its details
    monkeypatch.setattr(ng, "merge_partitions", broken)
    assert run_cli([*argv, "--report-examples", "3"]) == 1
    assert not os.path.exists(os.path.join(out, "stats/report.html"))
    assert not os.path.exists(os.path.join(out, ".SUCCESS"))
    monkeypatch.undo()
    assert run_cli(argv) == 0
    assert open(os.path.join(out, "stats/report.html"), "rb").read() == page


def test_empty_states(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "eval" / "clean" / "test.jsonl", [{"text": "Glaciers carve moraines in the far north."}])
    write_jsonl(tmp_path / "eval" / "none" / "test.jsonl", [{"text": None}, {"text": 3}])  # no instance
    write_jsonl(tmp_path / "train" / "t.jsonl", [{"text": t["question"]} for t in gsm8k_rows("train")[:50]])
    out = str(tmp_path / "out")
    assert run_cli(["--eval", str(tmp_path / "eval"), "--train", str(tmp_path / "train"), "--output", out]) == 0
    page, p = page_of(out)
    assert "No contamination found" in p.root.find_all("p", "lede")[0].text()
    cards = {c.find_all("h3")[0].text(): c for c in p.root.find_all("section", "card")}
    assert set(cards) == {"clean", "none"}
    assert cards["clean"].find_all("p", "clean") and cards["none"].find_all("p", "empty")
    assert p.root.find_all("article", "example") == []


# ---------------------------------------------------------------------------------------
# Every n: planted overlaps whose counts differ at n = 3, 5 and 8
# ---------------------------------------------------------------------------------------

PLANTED_EVAL = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet",   # the whole text: at 3, 5 and 8
    "kilo lima mike november oscar papa quebec romeo",                   # 5 tokens: at 3 and 5
    "the total amount of money sierra tango uniform victor",            # boilerplate: at 3 and 5
    "the total amount of money whiskey xray yankee zulu",               # the same boilerplate
    "one two three four five six seven eight nine",                     # 3 tokens: at 3 only
    "nothing shared here at all in this sentence okay",                 # none
]
PLANTED_TRAIN = [
    "prefix alpha bravo charlie delta echo foxtrot golf hotel india juliet suffix",
    "we saw kilo lima mike november oscar today",
    "find the total amount of money spent",
    "what is the total amount of money left",
    "count one two three now",
]
PLANTED = {3: 5, 5: 4, 8: 1}      # n -> contaminated instances
PLANTED_ROWS = {3: 5, 5: 4, 8: 1}  # n -> training rows overlapping them


def planted_run(tmp_path: Path, details_format: str) -> str:
    write_jsonl(tmp_path / "eval" / "plant" / "test.jsonl", [{"text": t} for t in PLANTED_EVAL])  # no ids
    write_jsonl(tmp_path / "train" / "t.jsonl", [{"text": t} for t in PLANTED_TRAIN])
    out = str(tmp_path / "out")
    assert run_cli(["--eval", str(tmp_path / "eval"), "--train", str(tmp_path / "train"), "--output", out,
                    "--ngrams", "3", "5", "8", "--partitions", "3", "--details-format", details_format]) == 0
    return out


def frequent_from_details(details: list[dict[str, Any]], n: int) -> list[list[str]]:
    """The top n-grams at n as the report should list them, from the detail records: by
    instances, then training rows, then text."""
    ids, rows = defaultdict(set), defaultdict(set)
    for d in details:
        if d["n"] == n:
            ids[d["ngram"]].add(d["instance_id"])
            rows[d["ngram"]].add((d["train_path"], d["train_row"]))
    ranked = sorted(ids, key=lambda g: (-len(ids[g]), -len(rows[g]), g))[:rh.MAX_TOP_NGRAMS]
    return [[g, str(len(ids[g])), str(len(rows[g]))] for g in ranked]


@pytest.mark.parametrize("details_format", ["parquet", "jsonl"])
def test_every_n_has_its_own_counts_n_grams_and_evidence(tmp_path: Path, details_format: str) -> None:
    out = planted_run(tmp_path, details_format)
    stats = read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))
    assert {s["n"]: len(s["instance_ids"]) for s in stats} == PLANTED
    assert all(i.isdigit() for s in stats for i in s["instance_ids"])     # the stats keep the machine ids
    details = read_details(out)
    page, p = page_of(out)
    sections = {int(s.attrs["data-n"]): s for s in p.root.find_all("section", "at-n")}
    assert sorted(sections) == [3, 5, 8]
    for n, sec in sections.items():
        counts = sec.find_all("p", "counts")[0].text()
        assert f"n = {n}" in counts and f"{PLANTED[n]} of 6 instances" in counts
        assert f"{plural(PLANTED_ROWS[n], 'training row')}." in counts
        files, = sec.find_all("table", "files")
        assert [[td.text() for td in tr.find_all("td")] for tr in files.find_all("tr")[1:]] == \
            [[f"{tmp_path}/train/t.jsonl", str(PLANTED[n]), str(PLANTED_ROWS[n])]]
        grams, = sec.find_all("table", "ngrams")
        assert [[td.text() for td in tr.find_all("td")] for tr in grams.find_all("tr")[1:]] == \
            frequent_from_details(details, n)
        assert sec.find_all("article", "example")                         # evidence at this n
    # the boilerplate leads at n = 5: two instances share it
    assert frequent_from_details(details, 5)[0] == ["the total amount of money", "2", "2"]
    # rows without an id are named by file and row, never by their hash
    shown = {a.find_all("code")[0].text() for a in p.root.find_all("article", "example")}
    assert shown == {f"test.jsonl:{i}" for i in range(5)}
    assert not any(d["instance_id"] in page for d in details)

    md = open(os.path.join(out, "stats/report.md"), encoding="utf-8").read()
    assert not any(d["instance_id"] in md for d in details)
    for n in PLANTED:
        section = md.split(f"## plant at n = {n}\n")[1].split("\n## ")[0]
        assert f"{PLANTED[n]} of 6 instances" in section and f"{PLANTED_ROWS[n]} training rows at n = {n}" in section
        table = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and " | " in line]
        head = table.index(["| n-gram", f"instances at n = {n}", "training rows |"])
        got = [[cells[0][2:], cells[1], cells[2][:-2]] for cells in table[head + 1:head + 1 + len(
            frequent_from_details(details, n))]]
        assert got == frequent_from_details(details, n)
    # the evidence at n = 8: offsets and text on both sides
    at_8 = md.split("## plant at n = 8\n")[1]
    text, train = PLANTED_EVAL[0], PLANTED_TRAIN[0]
    start = train.index("alpha")
    assert f'- `test.jsonl:0` (eval row 0), eval text [0, {len(text)}) "{text}"' in at_8
    assert f'  - training `{tmp_path}/train/t.jsonl` row 0: [{start}, {start + len(text)}) "{text}"' in at_8


def test_the_example_page_is_what_make_report_example_writes(tmp_path: Path) -> None:
    # examples/decon_report.html is generated (make report-example), never edited by hand;
    # written here under another hash seed, it must be the same bytes
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fresh = tmp_path / "decon_report.html"
    subprocess.run([sys.executable, os.path.join(repo, "examples", "make_decon_report.py"), str(fresh)],
                   env={**os.environ, "PYTHONHASHSEED": "3"}, check=True, capture_output=True)
    with open(os.path.join(repo, "examples", "decon_report.html"), "rb") as f:
        assert fresh.read_bytes() == f.read(), "examples/decon_report.html is stale: run make report-example"
