"""``refinery dedup``: exact and near-duplicate rows found, listed with provenance, resumable.

A corpus of GSM8K train documents in three formats (``.jsonl``, ``.jsonl.gz``, a two-group
``.parquet``) with planted copies: exact ones (one only after prep's normalization: CR LF and
trailing spaces), one in other case (not exact: the same words), near ones (a few words
changed), and rows that are no document (no text, blank). Exact mode lists the exact copies
and nothing else; minhash mode lists the near ones too, each with the Jaccard a plain Python
oracle computes; both keep the first copy in input order; reruns write the same bytes,
sliced or not, on any partition count."""
from __future__ import annotations

import json
import random
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import gsm8k_texts, run_prep, shingle_jaccard, tree_digest, write_jsonl
from reliability_helpers import shard_texts
from test_exclude_overlaps import _decon, _drop_list

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.io.text import normalize_text


@dataclass(frozen=True)
class Planted:
    corpus: Path
    exact: dict[tuple[str, int], tuple[str, int]]  # copy -> the first row of its text
    near: dict[tuple[str, int], tuple[str, int]]   # near copy -> its original (oracle Jaccard >= 0.85)
    case: tuple[tuple[str, int], tuple[str, int]]  # (copy in upper case, its original)


def _edit(text: str, rng: random.Random, words: int) -> str:
    out = text.split(" ")
    for _ in range(words):
        out[rng.randrange(len(out))] = rng.choice(["apple", "zebra", "quartz", "violet"])
    return " ".join(out)


def _near_copy(text: str, rng: random.Random) -> str:
    for _ in range(50):
        copy = _edit(text, rng, 1 + len(text.split()) // 150)
        if shingle_jaccard(text, copy) >= 0.85:
            return copy
    raise AssertionError("no near copy of Jaccard 0.85")


def make_corpus(root: Path) -> Planted:
    texts = [t for t in gsm8k_texts(400) if len(t.split()) >= 60][:150]
    rng = random.Random(5)
    a = [{"id": f"a{i}", "text": t} for i, t in enumerate(texts[:60])]
    b = [{"id": f"b{i}", "text": t} for i, t in enumerate(texts[60:110])]
    c = [{"id": f"c{i}", "text": t} for i, t in enumerate(texts[110:150])]
    corpus = root / "corpus"
    pa_ = str(corpus / "a.jsonl")
    pb_ = str(corpus / "sub" / "b.jsonl.gz")
    pc_ = str(corpus / "c.parquet")
    exact, near = {}, {}  # input order: a.jsonl, c.parquet, sub/b.jsonl.gz (a copy is the later row)
    b[3]["text"] = texts[5]  # an exact copy in another file
    exact[(pb_, 3)] = (pa_, 5)
    c[7]["text"] = texts[5]  # and another: one cluster of three
    exact[(pc_, 7)] = (pa_, 5)
    b[10]["text"] = texts[20].replace("\n", "\r\n") + "   "  # the same once normalized
    exact[(pb_, 10)] = (pa_, 20)
    a[40]["text"] = texts[2]  # a copy in the same file
    exact[(pa_, 40)] = (pa_, 2)
    for src, (lst, i, path) in {(pa_, 7): (b, 20, pb_), (pa_, 30): (c, 2, pc_), (pb_, 1): (b, 30, pb_),
                                (pa_, 50): (a, 55, pa_)}.items():
        original = a[src[1]]["text"] if src[0] == pa_ else b[src[1]]["text"]
        lst[i]["text"] = _near_copy(original, rng)
        near[(path, i)] = src
    a[33]["text"] = texts[12].upper()  # the same words, another text: a near duplicate, not an exact one
    case = ((pa_, 33), (pa_, 12))
    a.insert(59, {"id": "no-text", "body": "x"})  # rows that are no document: at the end, not renumbering
    a.insert(59, {"id": "blank", "text": "   \n "})
    write_jsonl(corpus / "a.jsonl", a)
    write_jsonl(corpus / "sub" / "b.jsonl.gz", b)
    pq.write_table(pa.table({"id": [r["id"] for r in c], "text": [r["text"] for r in c]}), corpus / "c.parquet",
                   row_group_size=16)
    return Planted(corpus, exact, near, case)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Planted:
    return make_corpus(tmp_path_factory.mktemp("dedup"))


def dedup(corpus: Path, out: Path, *extra: object) -> int:
    return main(["dedup", "--input", str(corpus), "--output", str(out), "--runner", "direct", "--no-progress",
                 "--partitions", "3", *map(str, extra)])


def listed(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "dup_list.jsonl").read_text().splitlines()]


def pairs(out: Path) -> dict[tuple[str, int], tuple[str, int]]:
    return {(e["train_path"], e["train_row"]): (e["dup_of_path"], e["dup_of_row"]) for e in listed(out)}


def text_of(path: str, row: int) -> str:
    return next(str(r["text"]) for i, r, _ in iter_rows(path) if i == row and r is not None)


def test_exact_mode_lists_the_exact_copies_and_nothing_else(planted: Planted, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exact"
    assert dedup(planted.corpus, out, "--mode", "exact") == 0
    said = capsys.readouterr().out
    assert pairs(out) == planted.exact  # the normalized copy included; the upper-case one not
    assert all(e["jaccard"] == 1.0 and e["exact"] for e in listed(out))
    clusters = [json.loads(line) for line in (out / "clusters.jsonl").read_text().splitlines()]
    assert [(c["kept_path"], c["kept_row"], c["size"]) for c in clusters] == \
        [(str(planted.corpus / "a.jsonl"), 2, 2), (str(planted.corpus / "a.jsonl"), 5, 3),
         (str(planted.corpus / "a.jsonl"), 20, 2)]  # by kept row: the first copy in input order
    assert {e["cluster"] for e in listed(out)} == {0, 1, 2}
    assert "removed 4 of 150 documents" in said and "rows read 152 = documents 150 + empty 1 + without text 1" in said
    report = (out / "report.md").read_text()
    assert "| `" + str(planted.corpus / "a.jsonl") + "` | 62 | 60 | 1 | 1.67% |" in report
    assert "### cluster 1: 3 rows" in report  # the largest first


def test_minhash_mode_lists_near_copies_with_their_true_jaccard(planted: Planted, tmp_path: Path) -> None:
    out = tmp_path / "near"
    assert dedup(planted.corpus, out) == 0
    found = pairs(out)
    copy, original = planted.case
    assert found == {**planted.exact, **planted.near, copy: original}
    for e in listed(out):
        removed, kept = text_of(e["train_path"], e["train_row"]), text_of(e["dup_of_path"], e["dup_of_row"])
        assert e["jaccard"] == pytest.approx(shingle_jaccard(removed, kept), abs=1e-4)
        assert e["jaccard"] >= 0.8 and e["exact"] == ((e["train_path"], e["train_row"]) in planted.exact)
    stats = json.loads((out / "dedup_stats.json").read_text())
    assert stats["removed"] == len(found) and stats["verify"]["verified"] >= len(planted.near) + 1
    assert stats["skipped"]["buckets"] == 0


def test_a_rerun_a_sliced_run_and_other_partitions_write_the_same_lists(planted: Planted, tmp_path: Path) -> None:
    out = tmp_path / "one"
    assert dedup(planted.corpus, out) == 0
    first = tree_digest(out)
    assert dedup(planted.corpus, out) == 0
    assert tree_digest(out) == first  # nothing rerun, nothing rewritten
    (out / "dup_list.jsonl").unlink()
    assert dedup(planted.corpus, out) == 0
    assert tree_digest(out) == first  # the lost list written again, the same bytes
    other = tmp_path / "sliced"  # a.jsonl cut into byte slices, rows numbered across them
    assert main(["dedup", "--input", str(planted.corpus), "--output", str(other), "--runner", "direct",
                 "--no-progress", "--partitions", "5", "--slice-mb", "0.01"]) == 0
    assert len(list((other / ".refinery" / "sign").glob("*/receipts/*.json"))) > 4
    again = tree_digest(other)
    for name in ("dup_list.jsonl", "clusters.jsonl", "stats/input_files.jsonl"):
        assert again[name] == first[name], name


def test_a_bucket_over_the_cap_is_skipped_counted_and_named(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(2)
    base = [t for t in gsm8k_texts(50) if len(t.split()) > 80][0]
    rows = [{"text": base}] + [{"text": _edit(base, rng, 1)} for _ in range(7)]
    rows += [{"text": t} for t in gsm8k_texts(20, offset=100)]
    corpus = write_jsonl(tmp_path / "c" / "x.jsonl", rows).parent
    assert dedup(corpus, tmp_path / "wide") == 0
    assert len(listed(tmp_path / "wide")) == 7  # all seven copies, in one cluster
    capsys.readouterr()
    assert dedup(corpus, tmp_path / "capped", "--max-bucket", "3") == 0
    err = capsys.readouterr().err
    assert "band bucket(s) of more than --max-bucket texts were skipped" in err
    stats = json.loads((tmp_path / "capped" / "dedup_stats.json").read_text())
    assert stats["skipped"]["buckets"] >= 1 and stats["skipped"]["documents"] >= 4
    report = (tmp_path / "capped" / "report.md").read_text()
    assert "bucket(s) over the cap were skipped" in report and f"`{corpus / 'x.jsonl'}:" in report


def test_bad_flags_and_inputs_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_jsonl(tmp_path / "c" / "x.jsonl", [{"text": t} for t in gsm8k_texts(5)]).parent
    for extra, said in ((("--mode", "exact", "--threshold", "0.7"), "--threshold is a minhash setting"),
                        (("--threshold", "1.5"), "--threshold must be in (0, 1]"),
                        (("--max-bucket", "1"), "--max-bucket is too small"),
                        (("--text-field", "body"), "--text-field 'body': no row of")):
        assert dedup(corpus, tmp_path / "out", *extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    (tmp_path / "empty").mkdir()
    assert dedup(tmp_path / "empty", tmp_path / "out") == 2
    assert "empty: contains no data files" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------
# prep --exclude-duplicates, clean --exclude-duplicates, and with --exclude-overlaps
# ---------------------------------------------------------------------------------------

def kept_texts(corpus: Path, removed: set[tuple[str, int]]) -> Counter[str]:
    """The normalized text of every document of ``corpus`` but the ``removed`` rows (a multiset)."""
    out: Counter[str] = Counter()
    for f in storage.expand_inputs([str(corpus)]):
        for row, record, _ in iter_rows(f.path):
            text = normalize_text(str(record.get("text", ""))) if record is not None else ""
            if text and (f.path, row) not in removed:
                out[text] += 1
    return out


@pytest.fixture(scope="module")
def deduped(planted: Planted, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deduped") / "dedup"
    assert dedup(planted.corpus, out) == 0
    return out


def test_prep_and_clean_leave_the_listed_rows_out(planted: Planted, deduped: Path, tmp_path: Path) -> None:
    removed = set(pairs(deduped))
    assert run_prep([planted.corpus], tmp_path / "shards", "--exclude-duplicates", deduped, "--num-shards", 2) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["rows"]["excluded"] == len(removed) == manifest["excluded_overlaps"]["documents"]
    assert manifest["excluded_overlaps"]["dedup_runs"][0]["listed"] == len(removed)
    want = kept_texts(planted.corpus, removed)
    assert shard_texts(tmp_path / "shards") == want
    assert main(["clean", "--train", str(planted.corpus), "--exclude-duplicates", str(deduped), "--output",
                 str(tmp_path / "copy"), "--runner", "direct", "--no-progress"]) == 0
    copy = json.loads((tmp_path / "copy" / "_clean_manifest.json").read_text())
    assert copy["totals"]["rows_left_out"] == len(removed)
    assert run_prep([tmp_path / "copy"], tmp_path / "of-copy", "--num-shards", 2) == 0
    assert shard_texts(tmp_path / "of-copy") == want  # the copy tokenizes to what the exclusion keeps


def test_duplicates_and_overlaps_leave_out_their_union_in_one_run(planted: Planted, deduped: Path,
                                                                  tmp_path: Path) -> None:
    """Eval questions that are training rows (one of them duplicated): decon lists the rows that
    hold them, dedup the copies; a row in both lists is left out once; in span mode a listed
    duplicate is dropped whole, never cut into pieces."""
    a = str(planted.corpus / "a.jsonl")
    questions = [text_of(a, row).split("\n\n")[0] for row in (5, 8, 11)]  # row 5's text is in two copies
    evals = write_jsonl(tmp_path / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"q{i}", "text": q} for i, q in enumerate(questions)])
    assert _decon(planted.corpus, evals, tmp_path / "decon") == 0
    contaminated = {(str(Path(e["train_path"])), e["train_row"]) for e in _drop_list(tmp_path / "decon")}
    removed = set(pairs(deduped))
    both = contaminated & removed
    assert len(contaminated) >= 3 and both  # row 5's copies are in both lists
    args = ["--exclude-duplicates", deduped, "--exclude-overlaps", tmp_path / "decon", "--num-shards", 2]
    assert run_prep([planted.corpus], tmp_path / "shards", *args) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    union = contaminated | removed
    assert manifest["rows"]["excluded"] == len(union)
    runs = manifest["excluded_overlaps"]
    assert [r["listed"] for r in runs["decon_runs"]] == [len(contaminated)] and runs["dedup_runs"][0]["listed"] == \
        len(removed)
    assert shard_texts(tmp_path / "shards") == kept_texts(planted.corpus, union)
    assert run_prep([planted.corpus], tmp_path / "span", *args, "--exclude-mode", "span", "--exclude-window", 5) == 0
    cut = json.loads((tmp_path / "span" / "manifest.json").read_text())["excluded_overlaps"]
    assert cut["rows_split"] + cut["rows_dropped"] == len(union)  # each listed row met once: cut or dropped
    assert cut["rows_dropped"] >= len(removed) and cut["rows_split"] >= 1


def _copy_corpus(planted: Planted, root: Path) -> Path:
    shutil.copytree(planted.corpus, root / "corpus", copy_function=shutil.copy2)
    return root / "corpus"


def test_lists_that_cannot_be_trusted_are_refused_in_one_line(planted: Planted, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    corpus = _copy_corpus(planted, tmp_path)
    out = tmp_path / "dedup"
    assert dedup(corpus, out, "--mode", "exact") == 0
    decon = _decon_output(planted, tmp_path)
    capsys.readouterr()

    def refused(*extra: object, inputs: tuple[Path, ...] = (corpus,)) -> str:
        assert run_prep(list(inputs), tmp_path / "shards", *extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and not (tmp_path / "shards").exists(), err
        return err

    flag = ("--exclude-duplicates", out)
    assert "dedup read the training text from field 'text'; this prep reads template" in \
        refused(*flag, "--text-template", "{text}")
    assert "rerun dedup with --max-row-bytes 1000" in refused(*flag, "--max-row-bytes", 1000)
    assert "the dedup run read 2 file(s) this run does not" in refused(*flag, inputs=(corpus / "a.jsonl",))
    assert "not a refinery dedup output (its run record ends with stage 'merge', not report)" in \
        refused("--exclude-duplicates", decon)
    assert "not a refinery decon output (its run record ends with stage 'report', not merge)" in \
        refused("--exclude-overlaps", out)
    assert "--allow-unscanned-inputs needs --exclude-overlaps DECON_OUTPUT or --exclude-duplicates" in \
        refused("--allow-unscanned-inputs")
    listed_file = out / "dup_list.jsonl"
    original = listed_file.read_bytes()
    lines = original.splitlines(keepends=True)
    bumped = re.sub(rb'"train_row": (\d+)', lambda m: b'"train_row": %d' % ((int(m[1]) + 1) % 10 ** len(m[1])),
                    lines[0], count=1)  # another row of the same size: only the sha256 tells
    for edited in (b"".join(lines[1:]), b"".join([bumped, *lines[1:]])):
        listed_file.write_bytes(edited)
        err = refused(*flag)  # a line gone (a size the receipt does not record), or a row changed (its sha256)
        assert "dup_list.jsonl" in err and "edited after dedup wrote it" in err, err
    listed_file.write_bytes(original)
    with (corpus / "a.jsonl").open("a") as f:
        f.write(json.dumps({"id": "late", "text": "a row written after dedup read the file"}) + "\n")
    assert "a.jsonl: changed since the dedup run" in refused(*flag)
    (out / ".SUCCESS").unlink()
    assert "not a finished dedup output (no .SUCCESS)" in refused(*flag)
    assert main(["clean", "--train", str(corpus), "--output", str(tmp_path / "copy")]) == 2
    assert "give --exclude-overlaps DECON_OUTPUT... (the decon runs" in capsys.readouterr().err


def _decon_output(planted: Planted, root: Path) -> Path:
    evals = write_jsonl(root / "ev" / "gsm8k" / "test.jsonl", [{"id": "q", "text": "no such question at all here"}])
    assert _decon(planted.corpus, evals, root / "decon") == 0
    return root / "decon"


# ---------------------------------------------------------------------------------------
# The public PTransforms
# ---------------------------------------------------------------------------------------

def test_the_transforms_find_what_the_command_lists(planted: Planted, deduped: Path, tmp_path: Path) -> None:
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline as BeamPipeline  # not a test class to collect
    from apache_beam.testing.util import assert_that, equal_to

    from refinery.transforms.decon.stages import expand_as_given
    from refinery.transforms.dedup import DedupPipeline, DropDuplicates, FindDuplicates, MinHashSignatures
    from refinery.transforms.dedup.stages import DedupConfig
    from refinery.transforms.io.rows import SourceRow

    rows = [SourceRow(f.path, i, r, f.relpath) for f in storage.expand_inputs([str(planted.corpus)])
            for i, r, _ in iter_rows(f.path) if r is not None]
    want = [(e["train_path"], e["train_row"], e["dup_of_path"], e["dup_of_row"], e["exact"]) for e in listed(deduped)]
    kept = [(r.path, r.row) for r in rows if (r.path, r.row) not in set(pairs(deduped))]
    with BeamPipeline() as p:
        source = p | beam.Create(rows)
        dups = source | MinHashSignatures() | FindDuplicates()
        assert_that(dups | "Pairs" >> beam.Map(lambda d: (d.path, d.row, d.kept_path, d.kept_row, d.exact)),
                    equal_to(want), label="pairs")
        left = source | DropDuplicates(dups) | "Keys" >> beam.Map(lambda r: (r.path, r.row))
        assert_that(left, equal_to(kept), label="kept")
    out = tmp_path / "composite"
    inputs = expand_as_given([str(planted.corpus)])
    with BeamPipeline() as p:
        _ = p | DedupPipeline(DedupConfig(output=str(out), partitions=3), inputs, str(out))
    digest = tree_digest(out)
    for name in ("dup_list.jsonl", "clusters.jsonl", "report.md"):
        assert digest[name] == tree_digest(deduped)[name], name


# ---------------------------------------------------------------------------------------
# Scale: the job does not grow with the corpus
# ---------------------------------------------------------------------------------------

def _job_bytes(root: Path, files: int, out: Path) -> int:
    import pickle

    from refinery.runners.translate import command_pipeline, runner_api
    from refinery.transforms.dedup.stages import DedupConfig, build_stages
    from refinery.transforms.resumable import bind_stages

    for i in range(files):
        write_jsonl(root / f"{i // 100:03d}" / f"f{i:05d}.jsonl", [{"id": f"d{i}", "text": f"document {i} words"}])
    stages = build_stages(DedupConfig(output=str(out)), storage.expand_inputs([str(root)]))
    pipeline = command_pipeline(stages, str(out), ["--runner=DirectRunner"])
    assert pipeline is not None
    sign = bind_stages(stages, str(out))[0]
    worker = pickle.loads(pickle.dumps(sign))  # what a job carries of the sign stage: no input list
    assert not hasattr(worker.stage, "inputs") and len(pickle.dumps(sign)) < 4000
    return len(runner_api(pipeline).SerializeToString())


def test_the_dedup_job_is_the_same_size_for_10x_the_files(tmp_path: Path) -> None:
    small = _job_bytes(tmp_path / "small", 100, tmp_path / "o1")
    big = _job_bytes(tmp_path / "big", 1000, tmp_path / "o2")
    assert big < 1.02 * small, (small, big)
