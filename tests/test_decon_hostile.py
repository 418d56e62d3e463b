"""decon under hostile eval sets: memory and output size bounded (no Beam)."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import gsm8k_rows

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.decon.ngrams.reduce import ReduceResult
from refinery.transforms.io.rows import Row

DEFAULT = ng.TOKENIZERS["default"]
COMMON = "the quick brown fox jumps over the lazy dog while the cat sleeps"  # 13 tokens

# One reduce in a fresh process: eval rows sharing n-grams (all the same text, or distinct
# texts holding one common 13-gram) against N training rows that hold them; prints how much
# the peak RSS grew during the reduce and what it wrote.
REDUCE = """
import json, resource, sys
from refinery.transforms.decon import ngrams as ng
kind, n_train, rows_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
common, fmt = sys.argv[4], sys.argv[5]
texts = [common + " and dreams"] * rows_n if kind == "identical" else [f"{common} row{i}" for i in range(rows_n)]
def read(path):
    for i, t in enumerate(texts):
        yield i, {"text": t, "id": f"e{i}"}, None
rows, _ = ng.make_eval_rows(["x/ds/test.jsonl"], read, "text", "id", ng.TOKENIZERS["default"])
index = ng.NgramIndex.build(rows, {}, [13], "default", 1)
train = ((j, {"text": f"doc {j}: {texts[0]}"}, None) for j in range(n_train))
hits = list(ng.scan_rows(train, text_field="text", tokenizer=ng.TOKENIZERS["default"],
                         membership=index.membership, lookup=index.lookup, partitions=1, stats=ng.ScanStats()))
blocks = [b for _, b in ng.hit_blocks([ng.hit_groups(h, "id") for h in hits])]
written = [0, 0]
def write(lines):
    written[0] += len(lines)
    written[1] = max(written[1], len(lines))
class Sink:  # Parquet: the bytes of the file, counted
    def write(self, data):
        write(memoryview(data).cast("B"))
        return len(memoryview(data).cast("B"))
from refinery.transforms.decon.ngrams import details as dt
columns = dt.EvalColumns.of(rows, ng.same_text(rows))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if fmt == "parquet":  # row groups of 8,192 rows: fewer than either fan-out
    out = dt.DetailRows(Sink(), columns, row_group_rows=8192)
    res = ng.reduce_partition(index.records[0], rows, [13], lambda: ((0, "t.jsonl", 0, b) for b in blocks), None,
                              None, rows_out=out)
    out.close()
    assert out.rows == res["details"]
else:
    res = ng.reduce_partition(index.records[0], rows, [13], lambda: ((0, "t.jsonl", 0, b) for b in blocks), None,
                              write)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_kb": grew, "details": res["details"], "chars": written[0], "largest_write": written[1]}))
"""


def reduce_in_subprocess(kind: str, n_train: int, rows: int = 2000, fmt: str = "jsonl") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", REDUCE, kind, str(n_train), str(rows), COMMON, fmt],
                         capture_output=True, text=True, timeout=120, check=True)
    got: dict[str, Any] = json.loads(out.stdout)
    return got


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("kind", ["identical", "distinct"])
def test_reduce_memory_stays_flat_as_the_fan_out_grows(kind: str, fmt: str) -> None:
    small, large = reduce_in_subprocess(kind, 5, fmt=fmt), reduce_in_subprocess(kind, 60, fmt=fmt)
    # the fan-out grew 12x; the reduce's memory must not follow it (Parquet: it follows the row group)
    assert large["grew_kb"] - small["grew_kb"] < 10_000, (small, large)
    if fmt == "jsonl":
        assert large["largest_write"] <= 2 * ng.WRITE_CHARS
    if kind == "identical":
        # one detail record per distinct text (3 n-grams x 60 training rows), not per eval row
        assert large["details"] == 3 * 60
    else:
        assert large["details"] == 60 * (2000 + 1)      # every eval row's record is written


# Every stage of ``refinery decon`` (the command's units, without Beam), each in a process of
# its own forked from one that has done the imports; prints how much each stage's peak RSS
# rose above the RSS of that process, and the size of the drop list. Eval rows as in REDUCE.
STAGES = """
import json, os, sys
from refinery.beam_pipelines import decon
from refinery.transforms.resumable import bind_stages, execute_unit
from refinery.transforms.decon.stages import build_stages
kind, rows_n, n_train, common, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
texts = [common + " and dreams"] * rows_n if kind == "identical" else [f"{common} row{i}" for i in range(rows_n)]
for name, lines in (("eval/ds/test.jsonl", [{"id": f"e{i}", "text": t} for i, t in enumerate(texts)]),
                    ("train/t.jsonl", [{"text": f"doc {j}: {texts[0]}"} for j in range(n_train)])):
    os.makedirs(os.path.dirname(f"{root}/{name}"), exist_ok=True)
    with open(f"{root}/{name}", "w") as f:
        f.writelines(json.dumps(line) + "\\n" for line in lines)
args = decon.build_parser().parse_args(["--eval", f"{root}/eval", "--train", f"{root}/train", "--output",
                                        f"{root}/out", "--ngrams", "13", "--partitions", "4"])
def kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
grew = {}
for run in bind_stages(build_stages(decon.settings_from_args(args)), args.output):
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            done = all(execute_unit(run, u)["status"] == "completed" for u in run.stage.plan())
            os.write(w, json.dumps([done, kb("VmHWM:")]).encode())
        finally:
            os._exit(0)
    os.close(w)
    done, peak = json.loads(os.read(r, 1024) or "[false, 0]")
    os.wait()
    assert done, run.name
    grew[run.name] = peak - kb("VmRSS:")
drop_list = f"{root}/out/stats/contaminated_train_docs.jsonl"
print(json.dumps({"grew_kb": grew, "drop_list_bytes": os.path.getsize(drop_list),
                  "drop_list_lines": sum(1 for _ in open(drop_list))}))
"""


def stages_in_subprocess(tmp_path: Path, kind: str, n_train: int, rows: int = 2000,
                         common: str = COMMON) -> dict[str, Any]:
    root = tmp_path / f"{kind}-{rows:06d}-{n_train:06d}"  # one length: the drop lists name it
    out = subprocess.run([sys.executable, "-c", STAGES, kind, str(rows), str(n_train), common, str(root)],
                         capture_output=True, text=True, timeout=120, check=True)
    got: dict[str, Any] = json.loads(out.stdout)
    return got


def grew_mb(small: dict[str, Any], large: dict[str, Any]) -> dict[str, float]:
    """How much more each stage's peak RSS rose in the large run than in the small one (MB)."""
    return {stage: (large["grew_kb"][stage] - small["grew_kb"][stage]) / 1024 for stage in small["grew_kb"]}


@pytest.mark.parametrize("kind", ["identical", "distinct"])
def test_every_stage_stays_flat_as_the_training_rows_grow(tmp_path: Path, kind: str) -> None:
    small, large = stages_in_subprocess(tmp_path, kind, 5), stages_in_subprocess(tmp_path, kind, 600)
    # 120x the training rows, each overlapping all 2,000 eval rows: no stage's memory follows
    # (before: the reduce and the merge held a code per (eval row, training row), +0.5-0.8 GB)
    assert max(grew_mb(small, large).values()) < 40, (small, large)
    assert large["drop_list_lines"] == 600
    # a line names the training row, its n and their instances' largest coverage, not the 2,000 instances it
    # overlaps (in the details)
    assert large["drop_list_bytes"] < 600 * 240


def test_every_stage_stays_flat_as_identical_eval_rows_grow(tmp_path: Path) -> None:
    question = gsm8k_rows("test")[0]["question"]  # about 40 13-grams
    small = stages_in_subprocess(tmp_path, "identical", 20, rows=200, common=question)
    large = stages_in_subprocess(tmp_path, "identical", 20, rows=5000, common=question)
    # 25x the rows of one text: the eval rows themselves cost a little; the index, its
    # partitions, the reduce and the merge hold the text's state once (before: +50-120 MB each)
    assert max(grew_mb(small, large).values()) < 30, (small, large)
    assert large["drop_list_bytes"] == small["drop_list_bytes"]  # a line names no eval row


# ---------------------------------------------------------------------------------------
# Pure pieces: index, scan, reduce and merge of a small run
# ---------------------------------------------------------------------------------------

def eval_rows(texts: list[str], dataset: str = "ds") -> list[ng.EvalRow]:
    def read(path: str) -> Iterator[Row]:
        for i, t in enumerate(texts):
            yield i, {"text": t, "id": f"e{i}"}, None
    rows, _ = ng.make_eval_rows([f"x/{dataset}/test.jsonl"], read, "text", "id", DEFAULT)
    return rows


def run(rows: list[ng.EvalRow], train: list[str], ns: list[int], max_ngram_details: int | None = None,
        partitions: int = 2) -> tuple[ReduceResult, list[dict[str, Any]]]:
    """Every partition's reduce (blocks and results through msgpack, as on disk), then the merge."""
    import msgpack

    index = ng.NgramIndex.build(rows, {}, ns, "default", partitions)
    hits = list(ng.scan_rows(((j, {"text": t}, None) for j, t in enumerate(train)), text_field="text",
                             tokenizer=DEFAULT, membership=index.membership, lookup=index.lookup,
                             partitions=partitions, stats=ng.ScanStats()))
    blocks = {p: msgpack.unpackb(msgpack.packb(b)) for p, b in ng.hit_blocks([ng.hit_groups(h, "id") for h in hits])}
    details: list[dict[str, Any]] = []
    results = []
    for p in range(partitions):
        def part_blocks(p: int = p) -> list[tuple[int, str, int, dict[str, Any]]]:
            return [(0, "t.jsonl", 0, blocks[p])] if p in blocks else []

        res = ng.reduce_partition(index.records.get(p, []), rows, ns, part_blocks, None,
                                  lambda lines: details.extend(map(json.loads, lines.splitlines())),
                                  max_ngram_details)
        results.append(msgpack.unpackb(msgpack.packb(res), strict_map_key=False))
    return ng.merge_partitions(rows, ns, results, DEFAULT), details


def test_identical_eval_texts_give_one_record_listing_their_instances() -> None:
    same = "the cat sat on the mat today"
    rows = eval_rows([same, same, "another text here entirely", same])
    result, details = run(rows, [f"x {same} y", same, "another text here"], [3])
    # one record per (text, training row, n-gram): the first row's, saying how many others share it
    shared = [d for d in details if d["eval_row"] != 2]
    assert {d["eval_row"] for d in shared} == {0} and len(shared) == 5 * 2     # 5 3-grams x 2 training rows
    assert all(list(d)[:5] == ["eval_dataset", "eval_path", "eval_row", "instance_id", "same_text"]
               and d["same_text"] == 2 for d in shared)
    own = [d for d in details if d["eval_row"] == 2]
    assert own and all("same_text" not in d for d in own)
    # the stats and metrics still count every instance
    assert result.overlap_stats[0]["instance_ids"] == ["e0", "e1", "e2", "e3"]
    metrics = {m["instance_id"]: m for m in result.metrics}
    assert metrics["e1"]["token"] == metrics["e3"]["token"] == metrics["e0"]["token"] == 1.0
    # the text once, listing the other instances
    lines = list(ng.overlap_instances(rows, result.overlaps))
    assert [(x["eval_row"], x.get("same_text")) for x in lines] == [
        (0, [{"eval_dataset": "ds", "eval_path": "x/ds/test.jsonl", "eval_row": 1, "instance_id": "e1"},
             {"eval_dataset": "ds", "eval_path": "x/ds/test.jsonl", "eval_row": 3, "instance_id": "e3"}]),
        (2, None)]
    # the report shows the text once, with its training hits, and says how many others have it
    report = ng.contamination_report(result, rows, [3], 20, (), (), {})
    examples = report.datasets[0].results[0].examples
    assert [(e.instance_id, e.same_text) for e in examples] == [("e0", 2), ("e2", 0)]
    assert [h.train_row for h in examples[0].hits] == [0, 1]


def test_a_training_row_in_every_partition_is_one_drop_list_line() -> None:
    """Each training row is in most partitions' shares; the merge (a window of rows at a time,
    tests/test_decon_droplist_windows.py) gives it one line, with its doc id once."""
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    result, _ = run(eval_rows([text]), [f"doc {j}: {text}" for j in range(20)], [3], partitions=8)
    lines = [json.loads(line) for line in b"".join(result.contaminated.chunks()).splitlines()]
    assert [d["train_row"] for d in lines] == list(range(20))


def test_max_ngram_details_caps_the_records_of_one_n_gram_and_says_so() -> None:
    rows = eval_rows([f"alpha beta gamma row{i}" for i in range(6)])
    train = ["alpha beta gamma"] * 4
    full, all_details = run(rows, train, [3])
    capped, details = run(rows, train, [3], max_ngram_details=10)
    assert len(all_details) == 6 * 4 and len(details) == 10
    assert details == all_details[:10]                   # scan order, then eval order
    assert capped.capped == [[3, "alpha beta gamma", 10, 24]] and full.capped == []
    assert capped.overlap_stats == full.overlap_stats and capped.metrics == full.metrics
    md = ng.render_report(capped, {}, None, max_ngram_details=10)
    assert "more than 10 detail records" in md and "14 records were left out" in md
    assert "capped" not in ng.render_report(full, {}, None, max_ngram_details=10)


def test_a_huge_token_gives_bounded_n_grams_and_snippets() -> None:
    token = "z" * 200_000
    text = f"intro {token} outro end"
    rows = eval_rows([text])
    train = f"{'a ' * 100}{text}{' b' * 100}"
    result, details = run(rows, [train], [3])
    assert len(details) == 2                               # "intro z.. outro", "z.. outro end"
    for d in details:
        assert len(json.dumps(d)) < 4 * ng.NGRAM_MAX_CHARS
        assert d["ngram_truncated"] is True and len(d["ngram"]) == ng.NGRAM_MAX_CHARS
        assert " ".join(DEFAULT.tokenize(text[slice(*d["eval_offsets"][0])])).startswith(d["ngram"])
        assert d["train_snippet_truncated"] is True and len(d["train_snippet"]) == ng.SNIPPET_MAX_CHARS
        lo = d["train_snippet_start"]
        assert d["train_snippet"] == train[lo:lo + ng.SNIPPET_MAX_CHARS]
        assert list(d).index("ngram_truncated") == list(d).index("ngram") + 1
        assert list(d)[-1] == "train_snippet_truncated"
    assert all(len(k) < ng.NGRAM_MAX_CHARS + 40 for per_n in result.overlaps.values() for grams in per_n.values()
               for k in grams)
    assert result.metrics[0]["token"] == 1.0
    # the report's snippet shows the long occurrence highlighted up to its end
    hit, = ng.contamination_report(result, rows, [3], 1, (), (), {}).datasets[0].results[0].examples[0].hits
    assert hit.cut_before and hit.cut_after and hit.snippet_spans[-1].end == len(hit.snippet)


def test_merged_snippet_tells_where_the_training_text_goes_on() -> None:
    # [hash, offsets, snippet_start, snippet]; the snippets of "text" around [60, 70) and [75, 80)
    text = "0123456789" * 20
    a = [1, [[60, 70]], 10, text[10:120]]
    b = [2, [[75, 80]], 25, text[25:130]]
    got = ng.merged_snippet([a, b])
    assert got.text == text[10:130] and got.spans == [(50, 60), (65, 70)] and got.cut_before and got.cut_after
    ended = [1, [[0, 10]], 0, text[0:40]]                   # asked for [0, 60): the text ended at 40
    got = ng.merged_snippet([ended])
    assert not got.cut_before and not got.cut_after


# ---------------------------------------------------------------------------------------
# The command: flag, warning, outputs
# ---------------------------------------------------------------------------------------

def test_decon_collapses_caps_and_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gzip

    from helpers import write_jsonl
    from test_decon_pipeline import run_cli

    from refinery.beam_pipelines import decon

    question = "What is the capital city of France and how old is it"
    rows = [{"id": f"same{i}", "text": question} for i in range(30)]
    rows += [{"id": f"other{i}", "text": f"capital city of France trivia number {i}"} for i in range(8)]
    write_jsonl(tmp_path / "eval" / "trivia" / "test.jsonl", rows)
    write_jsonl(tmp_path / "train" / "t.jsonl", [{"text": f"Doc {j}. {question}? Paris."} for j in range(3)])
    out = tmp_path / "out"
    assert run_cli(["--eval", str(tmp_path / "eval"), "--train", str(tmp_path / "train"), "--output", str(out),
                    "--ngrams", "4", "--partitions", "2", "--max-ngram-details", "5"]) == 0
    err = capsys.readouterr().err
    assert "WARNING refinery decon: 1 n-gram(s) had more than 5 detail records" in err
    assert "'capital city of france'" in err and "--max-ngram-details" in err
    details = list(read_details(str(out)))
    shared = [d for d in details if d["instance_id"].startswith("same")]
    assert {d["instance_id"] for d in shared} == {"same0"} and {d["same_text"] for d in shared} == {29}
    by_gram: dict[str, int] = {}
    for d in details:
        by_gram[d["ngram"]] = by_gram.get(d["ngram"], 0) + 1
    assert by_gram["capital city of france"] == 5 and max(by_gram.values()) == 5
    with gzip.open(out / "stats/overlap_instances.jsonl.gz", "rt") as f:
        instances = [json.loads(line) for line in f]
    first, = [i for i in instances if i["instance_id"].startswith("same")]
    assert [s["instance_id"] for s in first["same_text"]] == [f"same{i}" for i in range(1, 30)]
    stats = [json.loads(line) for line in open(out / "stats/overlap_stats.jsonl")]
    assert len(stats[0]["instance_ids"]) == 38                          # every instance still counted
    assert "detail records capped" in (out / "stats/report.md").read_text()
    page = (out / "stats/report.html").read_text()
    assert page.count("29 other instances with exactly this text") == 1
    assert "<th><bdi>max-ngram-details</bdi></th><td><bdi>5</bdi></td>" in page
    # the flag: a positive count or none
    assert decon.build_parser().parse_args(["--train", "t", "--output", "o"]).max_ngram_details == \
        ng.DEFAULT_MAX_NGRAM_DETAILS
    assert decon.build_parser().parse_args(["--train", "t", "--output", "o", "--max-ngram-details",
                                            "none"]).max_ngram_details is None
    with pytest.raises(SystemExit):
        decon.build_parser().parse_args(["--train", "t", "--output", "o", "--max-ngram-details", "0"])
    assert "expected a positive integer or 'none', got '0'" in capsys.readouterr().err


def stats_files(out: Path) -> dict[str, bytes]:
    """Every file under ``out/stats`` (gzip members inflated; the Parquet details' rows), by name."""
    import gzip

    return {p.name: (json.dumps(list(read_details(str(out)))).encode() if p.is_dir() else
                     gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes())
            for p in sorted((out / "stats").iterdir())}


def test_a_scan_unit_holds_a_bounded_number_of_snippet_characters(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import write_jsonl
    from test_decon_pipeline import run_cli

    from refinery.transforms.decon import stages
    from refinery.transforms.decon.ngrams import droplist

    question = gsm8k_rows("test")[0]["question"]
    write_jsonl(tmp_path / "eval" / "gsm8k" / "test.jsonl", [{"id": "q", "text": question}])
    # one batch of 300 rows, each holding all the question's n-grams: 2.5M snippet characters
    write_jsonl(tmp_path / "train" / "t.jsonl", [{"text": f"Doc {j}. {question} Answer."} for j in range(300)])
    argv = ["--eval", str(tmp_path / "eval"), "--train", str(tmp_path / "train"), "--ngrams", "5", "13"]
    assert run_cli(argv + ["--output", str(tmp_path / "default")]) == 0

    held, hit_blocks = [], ng.hit_blocks

    def counted(groups: list[ng.HitGroups]) -> Iterator[tuple[int, dict[str, Any]]]:
        held.append(sum(len(s) for g in groups for s in g.snippet))
        return hit_blocks(groups)

    monkeypatch.setattr(ng, "hit_blocks", counted)
    monkeypatch.setattr(stages, "HELD_CHARS", 20_000)
    monkeypatch.setattr(droplist, "LINES_AT_ONCE", 3)  # the drop list made a few lines at a time
    assert run_cli(argv + ["--output", str(tmp_path / "small")]) == 0
    assert len(held) > 50 and sum(held) > 2_000_000
    assert max(held) <= 20_000 + 20_000 // 4 + ng.SNIPPET_MAX_CHARS  # before: the whole batch's at once
    # the same hits in more, smaller frames, and the same drop list made in pieces: the same bytes
    assert stats_files(tmp_path / "small") == stats_files(tmp_path / "default")


def test_the_drop_list_names_each_row_once_whatever_the_eval_rows_sharing_its_text(tmp_path: Path) -> None:
    import glob
    import gzip

    import msgpack
    from helpers import write_jsonl
    from test_decon_pipeline import run_cli

    from refinery.transforms.formats.droplist import ReadSpec
    from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
    from refinery.transforms.io.text import TEXT_NORMALIZATION
    from refinery.transforms.prep.exclusion import load_exclusion

    shared, own, other = "the cat sat on the mat", "a dog ran far away", "birds sing in the morning"
    alpha = write_jsonl(tmp_path / "eval" / "alpha" / "test.jsonl",
                        [{"id": "a0", "text": shared}, {"id": "a1", "text": own}, {"id": "a2", "text": shared},
                         {"id": "a3", "text": shared}])
    write_jsonl(tmp_path / "eval" / "beta" / "test.jsonl",
                [{"id": "b0", "text": shared}, {"id": "b1", "text": other}, {"id": "b2", "text": shared}])
    train = write_jsonl(tmp_path / "train" / "t.jsonl",
                        [{"id": "d0", "text": f"x {shared} y"}, {"id": "d1", "text": own},
                         {"id": "d2", "text": f"{shared} and {other}"}, {"id": "d3", "text": "nothing here at all"}])
    out = tmp_path / "out"
    assert run_cli(["--eval", str(tmp_path / "eval"), "--train", str(train), "--output", str(out), "--ngrams", "4",
                    "--partitions", "3"]) == 0
    lines = [json.loads(line) for line in (out / "stats" / "contaminated_train_docs.jsonl").read_text().splitlines()]
    # one line per training row, naming the row and its n, never the eval rows (nor a shared text's)
    assert lines == [{"train_path": str(train), "train_row": r, "train_doc_id": f"d{r}", "ns": [4],
                      "max_coverage": [1.0]} for r in range(3)]  # each row holds an instance whole
    # full provenance: overlap_instances.jsonl.gz lists every row of the shared text, by its first row
    with gzip.open(out / "stats" / "overlap_instances.jsonl.gz", "rt") as f:
        instances = {(i["eval_path"], i["eval_row"]): [i, *i.get("same_text", [])] for i in map(json.loads, f)}
    assert sorted(i["instance_id"] for i in instances[(str(alpha), 0)]) == ["a0", "a2", "a3", "b0", "b2"]
    # prep --exclude-overlaps reads it
    spec = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)
    assert load_exclusion([str(out)], read_spec=spec).rows == {str(train.resolve()): frozenset({0, 1, 2})}
    # the index lists the shared text's n-grams once, for its first row
    listed = {i for p in glob.glob(str(out / ".refinery" / "index" / "*" / "parts" / "partitions" / "*.msgpack"))
              for record in msgpack.unpackb(open(p, "rb").read()) for i, _ in record[3]}
    assert listed == {0, 1, 5}  # alpha rows 0 and 1, beta row 1 (eval_idx 5)
