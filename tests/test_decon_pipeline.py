"""End-to-end tests of ``refinery decon`` (index -> scan -> reduce -> merge on the stage machinery)."""
from __future__ import annotations

import gzip
import json
import os
import random
import re
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import GSM8K_TEST, gsm8k_rows

from refinery.beam_pipelines import decon
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import details as dt
from refinery.transforms.decon.stages import DeconSettings, build_stages
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.resumable import run_stages

HELM_RE = re.compile(rf"[\s{re.escape(string.punctuation)}]+")
DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
DETAIL_KEYS = ["eval_dataset", "eval_path", "eval_row", "instance_id", "n", "ngram", "eval_offsets", "train_path",
               "train_row", "train_doc_id", "train_offsets", "train_snippet_start", "train_snippet"]
INSTANCE_KEYS = ["eval_dataset", "eval_path", "eval_row", "instance_id", "eval_text", "by_n"]


def helm(text: str) -> list[str]:
    return HELM_RE.split(text.lower())


def run_cli(argv: list[str], beam_args: list[str] = DIRECT) -> int:
    args, extra = decon.build_parser().parse_known_args(argv + ["--no-progress"])
    assert not extra
    return decon.run(args, list(beam_args))


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return [json.loads(line) for line in f]


def read_details(out: str) -> list[dict[str, Any]]:
    """The detail records, whichever the format (a lone surrogate as its escape)."""
    return list(dt.read_details(out))


def read_instances(out: str) -> dict[tuple[str, int], dict[str, Any]]:
    """overlap_instances.jsonl.gz by (eval_path, eval_row); each instance is there once."""
    with gzip.open(os.path.join(out, "stats/overlap_instances.jsonl.gz"), "rb") as f:
        rows = [json.loads(line) for line in f]
    assert all(list(r) == INSTANCE_KEYS for r in rows)
    by_key = {(r["eval_path"], r["eval_row"]): r for r in rows}
    assert len(by_key) == len(rows)
    return by_key


def training_texts(details: list[dict[str, Any]]) -> dict[tuple[str, int], str]:
    """The text of every training row the details name, read back from the training files."""
    out = {}
    for path in {d["train_path"] for d in details}:
        for row, record, error in iter_rows(path):
            if error is None and record is not None:
                out[(path, row)] = record["text"]
    return out


def check_detail_offsets(out: str, details: list[dict[str, Any]]) -> None:
    """Every detail holds complete provenance: the eval instance's text (written once, in
    overlap_instances) and the training text hold the n-gram at the recorded offsets, and the
    snippet is the training text at its start, around the first occurrence."""
    instances = read_instances(out)
    assert set(instances) == {(d["eval_path"], d["eval_row"]) for d in details}
    train = training_texts(details)
    for d in details:
        assert list(d) == DETAIL_KEYS and len(d["ngram"].split(" ")) == d["n"]
        inst = instances[(d["eval_path"], d["eval_row"])]
        assert (inst["eval_dataset"], inst["instance_id"]) == (d["eval_dataset"], d["instance_id"])
        for s, e in d["eval_offsets"]:
            assert dt.utf8(" ".join(helm(inst["eval_text"][s:e]))) == d["ngram"]  # a lone surrogate escaped
        text = train[(d["train_path"], d["train_row"])]
        for s, e in d["train_offsets"]:
            assert dt.utf8(" ".join(helm(text[s:e]))) == d["ngram"]
        lo, snippet = d["train_snippet_start"], d["train_snippet"]
        s, e = d["train_offsets"][0]
        assert lo == max(0, s - ng.SNIPPET_CONTEXT) and snippet == dt.utf8(text[lo:e + ng.SNIPPET_CONTEXT])


def write_jsonl(path: str, rows: Iterable[dict[str, Any]], compress: str | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    if compress == "gz":
        data = gzip.compress(data)
    elif compress == "zst":
        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------------------------------
# real data: gsm8k, agreement with the straightforward implementation
# ---------------------------------------------------------------------------------------

def test_gsm8k_agrees_with_reference(tmp_path: Path) -> None:
    """HELM conformance: with --match-fold none --min-eval-tokens 0 (HELM's exact text, every
    eval row indexed), the instance sets and details of the straightforward implementation."""
    test_rows = gsm8k_rows("test")
    train = gsm8k_rows("train")[:4000]
    rnd = random.Random(3)
    docs = []
    planted = set()
    for i, r in enumerate(train):
        text = r["question"] + "\n" + r["answer"]
        if i % 50 == 0:
            k = rnd.randrange(len(test_rows))
            planted.add(k)
            text = f"{text}\n\nRelated: {test_rows[k]['question']}"
        docs.append({"text": text, "source": "gsm8k-train", "n": i})
    write_jsonl(str(tmp_path / "train/part-0.jsonl"), docs[:2500])              # sliced by bytes
    write_jsonl(str(tmp_path / "train/part-1.jsonl.zst"), docs[2500:], "zst")   # one unit
    out = str(tmp_path / "out")
    rc = run_cli(["--eval", str(GSM8K_TEST), "--eval-text-field", "question",
                  "--train", str(tmp_path / "train"), "--output", out, "--ngrams", "5", "9", "13",
                  "--partitions", "16", "--slice-mb", "0.4", "--match-fold", "none", "--min-eval-tokens", "0"])
    assert rc == 0 and os.path.exists(os.path.join(out, ".SUCCESS"))

    helm_tok = ng.get_tokenizer("default", "none")
    evrows, _ = ng.make_eval_rows([str(GSM8K_TEST)], iter_rows, "question", "id", helm_tok)
    train_paths = [str(tmp_path / "train/part-0.jsonl")] * 2500 + [str(tmp_path / "train/part-1.jsonl.zst")] * 1500
    rows_in_file = list(range(2500)) + list(range(1500))
    ref_ids, ref_details = ng.reference_overlap(
        evrows, ((p, r, d["text"]) for p, r, d in zip(train_paths, rows_in_file, docs)), [5, 9, 13], helm_tok)

    stats = read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))
    assert [(s["eval_dataset"], s["n"]) for s in stats] == [("gsm8k", 5), ("gsm8k", 9), ("gsm8k", 13)]
    for s in stats:
        assert s["num_instances"] == 1319
        assert s["instance_ids"] == ref_ids[(s["eval_dataset"], s["n"])]
    ids13 = set(stats[2]["instance_ids"])
    assert {evrows[k].instance_id for k in planted} <= ids13

    details = read_details(out)
    by_row = {(r.eval_path, r.eval_row): r.eval_idx for r in evrows}
    got = {(by_row[(d["eval_path"], d["eval_row"])], d["train_path"], d["train_row"], d["n"], d["ngram"])
           for d in details}
    assert got == ref_details and len(details) == len(ref_details)
    check_detail_offsets(out, details)
    for d in details:  # row numbers across byte slices are file-global
        doc = docs[d["train_row"] + (2500 if d["train_path"].endswith(".zst") else 0)]
        # an id-less training row is named as prep names it (formats.row_ids): relpath:row, row file-global
        relpath = os.path.relpath(d["train_path"], str(tmp_path / "train"))
        assert d["train_snippet"] in doc["text"] and d["train_doc_id"] == f"{relpath}:{d['train_row']}"

    receipts = [json.load(open(os.path.join(dp, f))) for dp, _, fs in os.walk(os.path.join(out, ".refinery/scan"))
                if dp.endswith("receipts") for f in fs if f.endswith(".json")]
    assert len(receipts) > 2 and all(r["stats"]["false_hits"] == 0 for r in receipts)
    metrics = read_jsonl(os.path.join(out, "stats/overlap_metrics.jsonl"))
    assert len(metrics) == 1319 * 3
    assert {m["instance_id"] for m in metrics if m["n"] == 13 and m["binary"]} == ids13
    report = open(os.path.join(out, "stats/report.md")).read()
    assert "| gsm8k | 13 |" in report


# ---------------------------------------------------------------------------------------
# formats, multi-dataset matrix, short/empty rows, ids
# ---------------------------------------------------------------------------------------

MMLU_Q = "Which of the following best describes the structure of a typical eukaryotic cell membrane?"
GSM_Q = "Tom has 3 apples and buys 4 more apples at the store. How many apples does Tom have now?"
ARC_Q = "Plants make their own food through a process called photosynthesis in the leaves."


def make_matrix_inputs(root: str | Path) -> tuple[str, str]:
    ev = os.path.join(root, "decontamination")
    write_jsonl(f"{ev}/mmlu-dolma-abcdef/test.jsonl.gz", [
        {"id": 100005, "text": MMLU_Q},
        {"id": None, "text": "Short one."},          # short row, id null -> hash of the record
        {"id": "p", "text": "?!"},                    # punctuation only: never overlaps
        {"id": "q", "text": "Nothing in common with any training document at all, really none."},
        {"id": "s", "text": "broken \ud800 surrogate inside an eval question"},
    ], "gz")
    os.makedirs(f"{ev}/gsm8k-3fa9c1", exist_ok=True)
    pq.write_table(pa.table({"text": [GSM_Q, "Completely unrelated eval text about glaciers and moraines here."],
                             "answer": ["7", "none"], "level": [1, 2]}), f"{ev}/gsm8k-3fa9c1/test.parquet")
    os.makedirs(f"{ev}/arc-dolma", exist_ok=True)
    with open(f"{ev}/arc-dolma/test.json", "w") as f:
        json.dump([{"id": "arc-1", "text": ARC_Q}], f)

    tr = os.path.join(root, "train")
    both = f"Study notes. {MMLU_Q} Also: {GSM_Q.upper()} The end."
    write_jsonl(f"{tr}/a.jsonl.zst", [{"text": "filler text " * 20}, {"text": both, "id": "doc-both"},
                                      {"text": "a broken \ud800 surrogate inside an eval question too", "x": "\udfff"}],
                "zst")
    os.makedirs(f"{tr}/sub", exist_ok=True)
    with open(f"{tr}/sub/b.json", "w") as f:
        json.dump([{"text": "We say: short one! and again short one."}, {"text": "nothing"}], f)
    pq.write_table(pa.table({"text": ["x", f"copy: {GSM_Q}"], "url": ["u1", "u2"]}), f"{tr}/c.parquet",
                   row_group_size=1)
    write_jsonl(f"{tr}/d.jsonl", [{"text": f"row {i} " + ("lorem ipsum " * 30)} for i in range(40)]
                + [{"text": f"late row mentions {ARC_Q}"}])
    return ev, tr


def test_formats_matrix_and_rows(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    out = str(tmp_path / "out")
    rc = run_cli(["--eval", ev, "--train", tr, "--output", out, "--ngrams", "3", "13",
                  "--partitions", "4", "--slice-mb", "0.002", "--min-eval-tokens", "1"])  # HELM: every row
    assert rc == 0
    stats = read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))
    assert all(s.pop("num_short_instances") == 0 and s.pop("short_instance_ids") == [] for s in stats)
    # the clean subsets' ids, rows and the ids never checked (mmlu's empty row): the rest of num_instances
    assert [(s.pop("num_clean_instances"), s.pop("num_clean_rows"), s.pop("num_unchecked_instances"))
            for s in stats] == [(0, 0, 0)] * 2 + [(1, 1, 0)] * 2 + [(1, 1, 1)] * 2
    short_id = ng.record_hash_id({"id": None, "text": "Short one."})
    gsm_id = ng.record_hash_id({"text": GSM_Q, "answer": "7", "level": 1})  # every parquet column
    assert stats == [
        {"eval_dataset": "arc", "n": 3, "num_instances": 1, "instance_ids": ["arc-1"]},
        {"eval_dataset": "arc", "n": 13, "num_instances": 1, "instance_ids": ["arc-1"]},
        {"eval_dataset": "gsm8k", "n": 3, "num_instances": 2, "instance_ids": [gsm_id]},
        {"eval_dataset": "gsm8k", "n": 13, "num_instances": 2, "instance_ids": [gsm_id]},
        {"eval_dataset": "mmlu", "n": 3, "num_instances": 5, "instance_ids": sorted(["100005", short_id, "s"])},
        {"eval_dataset": "mmlu", "n": 13, "num_instances": 5, "instance_ids": sorted(["100005", short_id, "s"])},
    ]
    # lone surrogates survive as escapes (JSON's, read back as text); the record hash covers them
    sur = [d for d in read_details(out) if d["instance_id"] == "s"]
    assert {d["ngram"] for d in sur} == {"broken \\ud800 surrogate", "\\ud800 surrogate inside",
                                         "surrogate inside an", "inside an eval", "an eval question",
                                         "broken \\ud800 surrogate inside an eval question"}  # 7 tokens < 13
    assert sur[0]["train_doc_id"] == f"{sur[0]['train_path'][len(tr) + 1:]}:{sur[0]['train_row']}"  # as prep names it
    details = read_details(out)
    check_detail_offsets(out, details)
    both = [d for d in details if d["train_doc_id"] == "doc-both"]
    assert {d["eval_dataset"] for d in both} == {"mmlu", "gsm8k"}       # matrix: under both datasets
    assert all(d["train_path"] == f"{tr}/a.jsonl.zst" and d["train_row"] == 1 for d in both)
    short = [d for d in details if d["instance_id"] == short_id]
    # the short row's one 3-gram "short one " (n=13 -> effective 3), and its 3-gram at n=3
    assert {(d["n"], d["ngram"]) for d in short} == {(3, "short one ")}
    assert [d["train_offsets"] for d in short] == [[[29, 39]]]  # only at the end: "one." then row end
    late = [d for d in details if d["eval_dataset"] == "arc"]
    assert {d["train_path"] for d in late} == {f"{tr}/d.jsonl"} and {d["train_row"] for d in late} == {40}
    pq_rows = {(d["train_path"], d["train_row"]) for d in details if d["train_path"].endswith(".parquet")}
    assert pq_rows == {(f"{tr}/c.parquet", 1)}
    assert "c.parquet:1" in {d["train_doc_id"] for d in details}  # the id-less parquet row, as prep names it
    assert {d["eval_path"] for d in details} == {f"{ev}/mmlu-dolma-abcdef/test.jsonl.gz",
                                                 f"{ev}/gsm8k-3fa9c1/test.parquet", f"{ev}/arc-dolma/test.json"}
    by_path = read_jsonl(os.path.join(out, "stats/overlap_stats_by_train_path.jsonl"))
    assert {(r["train_path"], r["eval_dataset"], r["n"]) for r in by_path} >= {
        (f"{tr}/a.jsonl.zst", "mmlu", 13), (f"{tr}/a.jsonl.zst", "gsm8k", 13), (f"{tr}/c.parquet", "gsm8k", 13),
        (f"{tr}/sub/b.json", "mmlu", 13), (f"{tr}/d.jsonl", "arc", 13)}
    summary = {r["eval_dataset"]: r for r in read_jsonl(os.path.join(out, "stats/eval_summary.jsonl"))}
    assert summary["mmlu"]["num_empty_instances"] == 1 and summary["mmlu"]["num_instances"] == 5
    scan_units = os.listdir(next(os.path.join(dp) for dp, ds, _ in os.walk(os.path.join(out, ".refinery/scan"))
                                 if dp.endswith("receipts")))
    assert len(scan_units) > 5  # d.jsonl in byte slices, c.parquet row groups


def test_rerun_skips_finished_units_and_reruns_what_changed(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    out = str(tmp_path / "out")
    s = DeconSettings(eval_paths=[ev], train_paths=[tr], ns=[3, 13], partitions=4, slice_bytes=2000)
    first = run_stages(build_stages(s), out, DIRECT, progress=False)
    assert first.ran["scan"] > 5 and first.ran["reduce"] == 4 and first.ran["merge"] == 1
    stats_before = open(os.path.join(out, "stats/overlap_stats.jsonl"), "rb").read()
    again = run_stages(build_stages(s), out, DIRECT, progress=False)
    assert again.ran == {} and set(again.skipped_stages) == {"eval", "index", "scan", "reduce", "merge"}
    # lose one scan part: the reduce and merge after it are complete, so nothing reads it and
    # nothing runs (intermediate files may be removed after a finished run)
    scan_run = again.runs[2]
    part = os.path.join(scan_run.parts_dir, "hits", "f00000-s0000.bin")
    part_bytes = open(part, "rb").read()
    os.remove(part)
    third = run_stages(build_stages(s), out, DIRECT, progress=False)
    assert third.ran == {} and not os.path.exists(part)
    # lose a final output too: the merge runs again, and the scan unit before it (unit outputs are
    # pure functions of their inputs, so the part comes back identical); the reduce's parts are there
    os.remove(os.path.join(out, "stats/overlap_stats.jsonl"))
    third = run_stages(build_stages(s), out, DIRECT, progress=False)
    assert third.ran == {"eval": 0, "index": 0, "scan": 1, "reduce": 0, "merge": 1}
    assert open(part, "rb").read() == part_bytes
    assert open(os.path.join(out, "stats/overlap_stats.jsonl"), "rb").read() == stats_before
    # a reduce-only setting: index and scan are kept
    s2 = DeconSettings(eval_paths=[ev], train_paths=[tr], ns=[3, 13], partitions=4, slice_bytes=2000,
                       max_train_count=0)
    fourth = run_stages(build_stages(s2), out, DIRECT, progress=False)
    assert fourth.ran == {"eval": 0, "index": 0, "scan": 0, "reduce": 4, "merge": 1}
    assert all(not r["instance_ids"] for r in read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl")))
    assert os.path.exists(os.path.join(out, ".SUCCESS"))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))


def test_damaged_hits_frame_and_details_member_fail_their_reader_and_are_rebuilt(tmp_path: Path) -> None:
    """A flipped byte in a scan unit's hits frame, or in a reduce unit's details member, left
    by the time the next stage reads it (as after a kill): the reader fails naming the file
    (the zstd frames carry checksums; the merge inflates each member it concatenates)
    instead of changing a snippet or writing a .gz with a CRC error. A rerun with
    --verify-checksums rebuilds the damaged unit and what follows, back to the clean bytes."""
    from helpers import tree_digest

    from refinery.transforms.resumable import StageFailed

    ev, tr = make_matrix_inputs(tmp_path)
    out = str(tmp_path / "out")
    s = DeconSettings(eval_paths=[ev], train_paths=[tr], ns=[3, 13], partitions=4, slice_bytes=2000,
                      details_format="jsonl")  # gzip members under the reduce's parts
    runs = run_stages(build_stages(s), out, DIRECT, progress=False).runs
    clean = tree_digest(Path(out))
    scan_run, reduce_run, merge_run = runs[2:]

    frames = [(length, offset, u.id) for u in scan_run.stage.plan()
              for _, offset, length in json.load(open(scan_run.receipt_path(u.id)))["stats"]["frames"]]
    length, offset, unit = max(frames)
    hits = os.path.join(scan_run.parts_dir, "hits", f"{unit}.bin")
    _flip(hits, offset + length // 2)
    for p in os.listdir(reduce_run.ledger.receipts_dir):  # the reduce (and so the merge) has not run yet
        os.remove(os.path.join(reduce_run.ledger.receipts_dir, p))
    os.remove(merge_run.receipt_path("merge"))
    with pytest.raises(StageFailed) as e:
        run_stages(build_stages(s), out, DIRECT, progress=False)
    assert e.value.stage == "reduce" and f"{hits} frame at bytes {offset}-{offset + length}: damaged" in str(e.value)
    again = run_stages(build_stages(s), out, DIRECT, progress=False, verify_checksums=True)
    assert again.ran == {"eval": 0, "index": 0, "scan": 1, "reduce": 4, "merge": 1}
    assert tree_digest(Path(out)) == clean

    member = max((os.path.join(reduce_run.parts_dir, "details", f) for f in os.listdir(os.path.join(
        reduce_run.parts_dir, "details"))), key=os.path.getsize)
    _flip(member, os.path.getsize(member) // 2)
    os.remove(merge_run.receipt_path("merge"))  # the merge has not run yet
    with pytest.raises(StageFailed) as e:
        run_stages(build_stages(s), out, DIRECT, progress=False)
    assert e.value.stage == "merge" and f"{member}: damaged gzip member" in str(e.value)
    assert read_details(out)  # the earlier, whole file: never replaced by a copy of the damage
    again = run_stages(build_stages(s), out, DIRECT, progress=False, verify_checksums=True)
    assert again.ran == {"eval": 0, "index": 0, "scan": 0, "reduce": 1, "merge": 1}
    assert tree_digest(Path(out)) == clean


def test_portable_runner_matches_direct(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    outs = {}
    for name, beam_args in [("direct", DIRECT),
                            ("portable", ["--runner=PortableRunner", "--job_endpoint=embed",
                                          "--environment_type=LOOPBACK"])]:
        out = str(tmp_path / name)
        assert run_cli(["--eval", ev, "--train", tr, "--output", out, "--ngrams", "3", "13",
                        "--partitions", "2"], beam_args) == 0
        outs[name] = (open(os.path.join(out, "stats/overlap_stats.jsonl"), "rb").read(),
                      sorted(os.listdir(os.path.join(out, "stats/overlap_details"))), read_details(out))
    assert outs["direct"] == outs["portable"]


def test_cli_errors_and_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train").mkdir()
    assert run_cli(["--eval", str(tmp_path / "nope"), "--train", str(tmp_path / "train"),
                    "--output", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    ev, tr = make_matrix_inputs(tmp_path)
    assert run_cli(["--eval", ev, "--train", tr, "--output", str(tmp_path / "o"), "--ngrams", "0"]) == 2
    try:
        from refinery.beam_pipelines import cli
    except ImportError:  # pragma: no cover
        pytest.skip("cli not available")
    out = str(tmp_path / "cli")
    rc = cli.main(["decon", "--eval", ev, "--train", tr, "--output", out, "--ngrams", "13", "--runner", "direct",
                   "--no-progress", "--tokenizer", "whitespace", "--max-train-count", "5"])
    assert rc == 0
    stats = read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))
    assert {s["eval_dataset"] for s in stats} == {"arc", "gsm8k", "mmlu"}
    run_info = json.load(open(os.path.join(out, ".refinery/run.json")))
    assert [st["name"] for st in run_info["stages"]] == ["eval", "index", "scan", "reduce", "merge"]


def test_a_remote_file_named_by_itself_keeps_its_path(tmp_path: Path) -> None:
    """`--eval gs://b/test.jsonl` named its file `gs://b/test.jsonl/test.jsonl`, which does not
    exist: every eval row was counted unreadable. A file named by itself keeps its path,
    remote or local; a folder's files are spelled under it."""
    import fsspec

    from refinery.transforms.decon.stages import expand_as_given

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/evalbucket/test.jsonl", b'{"id": "e0", "text": "a b c d"}\n')
    fs.pipe_file("/evalbucket/dir/x.jsonl", b'{"id": "e1", "text": "a b c d"}\n')
    try:
        assert [f.path for f in expand_as_given(["memory://evalbucket/test.jsonl"])] == ["memory://evalbucket/test.jsonl"]
        assert [f.path for f in expand_as_given(["memory://evalbucket/dir"])] == ["memory://evalbucket/dir/x.jsonl"]
        local = tmp_path / "t.jsonl"
        local.write_text('{"id": "e0", "text": "a b c d"}\n')
        assert [f.path for f in expand_as_given([str(local)])] == [str(local)]
    finally:
        fs.rm("/evalbucket", recursive=True)
