"""decon's detail records as Parquet (``--details-format parquet``, the default) and as JSON lines."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_decon_pipeline import make_matrix_inputs, run_cli

from refinery.beam_pipelines import decon
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import details as dt
from refinery.transforms.decon.stages import DeconSettings, build_stages
from refinery.transforms.resumable import bind_stages


def stats_files(out: Path) -> dict[str, bytes]:
    """The bytes of every file under ``out/stats`` (the clean subsets' folders too) but the details."""
    stats = out / "stats"
    return {str(p.relative_to(stats)): p.read_bytes() for p in sorted(stats.rglob("*"))
            if p.is_file() and p.relative_to(stats).parts[0] not in ("overlap_details", "overlap_details.jsonl.gz")}


def run_both(tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    ev, tr = make_matrix_inputs(tmp_path)
    outs = []
    for fmt in ("parquet", "jsonl"):
        out = tmp_path / fmt
        assert run_cli(["--eval", ev, "--train", tr, "--output", str(out), "--ngrams", "3", "13",
                        "--partitions", "3", "--details-format", fmt, *extra]) == 0
        outs.append(out)
    return outs[0], outs[1]


def test_parquet_and_jsonl_give_the_same_stats_drop_list_and_records(tmp_path: Path) -> None:
    parquet, jsonl = run_both(tmp_path)
    assert sorted(os.listdir(parquet / "stats/overlap_details")) == [f"part-{p:05d}.parquet" for p in range(3)]
    assert not (parquet / "stats/overlap_details.jsonl.gz").exists()
    assert not (jsonl / "stats/overlap_details").exists() and (jsonl / "stats/overlap_details.jsonl.gz").exists()
    # every stats file (the drop list, instance sets, metrics, report.md, report.html) the same bytes
    ours, theirs = stats_files(parquet), stats_files(jsonl)
    assert {"contaminated_train_docs.jsonl", "overlap_stats.jsonl", "clean/mmlu/n=13.jsonl.gz"} <= set(ours)
    assert ours == theirs
    records = list(dt.read_details(str(parquet)))
    assert len(records) > 10 and records == list(dt.read_details(str(jsonl)))
    assert {"same_text", "ngram_truncated", "train_snippet_truncated"}.isdisjoint(records[0])  # only when set
    assert any("\\ud800" in r["ngram"] for r in records)  # a lone surrogate, as its escape in both


def test_the_format_enters_the_reduce_hash_and_its_files_are_final(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    runs = {}
    for fmt in ("parquet", "jsonl"):
        args = decon.build_parser().parse_args(["--eval", ev, "--train", tr, "--output", str(tmp_path / "o"),
                                                "--details-format", fmt])
        runs[fmt] = {r.name: r for r in bind_stages(build_stages(decon.settings_from_args(args)), args.output)}
    assert runs["parquet"]["scan"].stage_hash == runs["jsonl"]["scan"].stage_hash
    for name in ("reduce", "merge"):
        assert runs["parquet"][name].stage_hash != runs["jsonl"][name].stage_hash
    assert runs["parquet"]["reduce"].traits.final_outputs and not runs["jsonl"]["reduce"].traits.final_outputs
    assert decon.build_parser().parse_args(["--train", "t", "--output", "o"]).details_format == "parquet"
    with pytest.raises(ValueError, match="--details-format must be one of parquet, jsonl, got 'csv'"):
        DeconSettings(eval_paths=[ev], train_paths=[tr], ns=[13], details_format="csv")


def test_no_details_of_another_run_stay_beside_the_current_ones(tmp_path: Path) -> None:
    ev, tr = make_matrix_inputs(tmp_path)
    out = tmp_path / "out"
    base = ["--eval", ev, "--train", tr, "--output", str(out), "--ngrams", "3", "13"]
    assert run_cli(base + ["--partitions", "5"]) == 0
    assert len(os.listdir(out / "stats/overlap_details")) == 5
    want = list(dt.read_details(str(out)))
    assert run_cli(base + ["--partitions", "2"]) == 0  # fewer partitions: parts 2-4 go
    assert sorted(os.listdir(out / "stats/overlap_details")) == ["part-00000.parquet", "part-00001.parquet"]
    assert sorted(map(json.dumps, dt.read_details(str(out)))) == sorted(map(json.dumps, want))
    assert run_cli(base + ["--partitions", "2", "--details-format", "jsonl"]) == 0
    assert not (out / "stats/overlap_details").exists()
    assert run_cli(base + ["--partitions", "2"]) == 0  # back: the jsonl file goes, the parts come again
    assert not (out / "stats/overlap_details.jsonl.gz").exists()
    assert len(os.listdir(out / "stats/overlap_details")) == 2
    assert sorted(map(json.dumps, dt.read_details(str(out)))) == sorted(map(json.dumps, want))
    assert decon_verify(out) == 0


def decon_verify(out: Path, *flags: str) -> int:
    from refinery.beam_pipelines import verify

    parser = __import__("argparse").ArgumentParser()
    verify.add_arguments(parser)
    return verify.run(parser.parse_args([str(out), *flags]), [])


def test_verify_names_a_missing_or_changed_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parquet, _ = run_both(tmp_path)
    assert decon_verify(parquet, "--checksums") == 0
    part = parquet / "stats/overlap_details/part-00001.parquet"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert decon_verify(parquet, "--checksums") == 1
    assert "stats/overlap_details/part-00001.parquet" in capsys.readouterr().out
    part.unlink()
    assert decon_verify(parquet) == 1
    assert "part-00001.parquet" in capsys.readouterr().out
    # the next run writes it again, the same bytes
    ev, tr = str(tmp_path / "decontamination"), str(tmp_path / "train")
    assert run_cli(["--eval", ev, "--train", tr, "--output", str(parquet), "--ngrams", "3", "13",
                    "--partitions", "3"]) == 0
    assert part.read_bytes() == data and decon_verify(parquet, "--checksums") == 0


def test_pyarrow_pandas_and_datasets_read_the_folder_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd
    import pyarrow.dataset as ds

    parquet, _ = run_both(tmp_path)
    folder = str(parquet / "stats/overlap_details")
    want = [{**r, **{k: r.get(k, v) for k, v in dt.OPTIONAL.items()}} for r in dt.read_details(str(parquet))]
    table = ds.dataset(folder, format="parquet").to_table()
    assert table.schema.equals(dt.SCHEMA) and table.to_pylist() == want
    frame = pd.read_parquet(folder)
    assert list(frame.columns) == dt.SCHEMA.names and len(frame) == len(want)
    assert str(frame["eval_dataset"].dtype) == "category"
    got = [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()}
           for row in frame.astype({"eval_dataset": str, "eval_path": str, "train_path": str}).to_dict("records")]
    got = [{**r, "eval_offsets": [list(p) for p in r["eval_offsets"]],
            "train_offsets": [list(p) for p in r["train_offsets"]]} for r in got]
    assert got == want
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    import datasets

    files = sorted(str(p) for p in Path(folder).iterdir())
    loaded = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert loaded.column_names == dt.SCHEMA.names and loaded.to_list() == want


# -- DetailRows without Beam ------------------------------------------------------------

def eval_rows(k: int) -> list[ng.EvalRow]:
    return [ng.EvalRow(i, "ds" if i % 2 else "other", f"e/{i % 3}.jsonl", i, f"id{i}", f"text {i}", 5, False)
            for i in range(k)]


def write_rows(adds: list[tuple[Any, ...]], rows_per_group: int, k: int = 10, same: ng.SameText | None = None) -> bytes:
    rows = eval_rows(k)
    buf = io.BytesIO()
    out = dt.DetailRows(buf, dt.EvalColumns.of(rows, same or ng.same_text(rows)), rows_per_group)
    for a in adds:
        out.add(*a)
    out.close()
    return buf.getvalue()


def hits(k: int) -> list[tuple[Any, ...]]:
    evals = [[i, [[i, i + 3], [i + 10, i + 13]]] for i in range(k)]
    few = [[1, [[0, 4]]]]
    return [(0, 3, "a b c", False, evals, k - 1, "t/x.jsonl", 7, "doc7", [(2, 5)], 0, "snip", False),
            (1, 3, "d e f", True, few, 1, "t/y.jsonl", 2, "doc\udc80", [(1, 2), (8, 9)], 1, "s\ud800", True),
            (0, 3, "a b c", False, evals, k, "t/x.jsonl", 9, "doc9", [(0, 3)], 0, "other snip", False)]


def test_detail_rows_are_the_same_whatever_the_row_groups() -> None:
    one, many = write_rows(hits(10), 1 << 17), write_rows(hits(10), 4)
    assert pq.ParquetFile(io.BytesIO(one)).metadata.num_row_groups == 1
    assert pq.ParquetFile(io.BytesIO(many)).metadata.num_row_groups > 4  # a fan-out is cut too
    table = pq.read_table(io.BytesIO(one))
    assert table.to_pylist() == pq.read_table(io.BytesIO(many)).to_pylist() and table.num_rows == 9 + 1 + 10
    rows = table.to_pylist()
    assert rows[0] == {"eval_dataset": "other", "eval_path": "e/0.jsonl", "eval_row": 0, "instance_id": "id0",
                       "same_text": 0, "n": 3, "ngram": "a b c", "ngram_truncated": False,
                       "eval_offsets": [[0, 3], [10, 13]], "train_path": "t/x.jsonl", "train_row": 7,
                       "train_doc_id": "doc7", "train_offsets": [[2, 5]], "train_snippet_start": 0,
                       "train_snippet": "snip", "train_snippet_truncated": False}
    assert [r["eval_row"] for r in rows] == [*range(9), 1, *range(10)]
    assert rows[9]["train_doc_id"] == "doc\\udc80" and rows[9]["train_snippet"] == "s\\ud800"
    assert rows[9]["train_offsets"] == [[1, 2], [8, 9]] and rows[9]["ngram_truncated"]
    assert rows[12]["eval_offsets"] == [[2, 5], [12, 15]] and rows[12]["train_row"] == 9
    assert dt.record_of(rows[9])["train_snippet_truncated"] and "same_text" not in dt.record_of(rows[9])


def test_same_text_counts_the_other_rows() -> None:
    same = ng.SameText({0: [2, 3]}, {2: 0, 3: 0})
    data = write_rows([(0, 3, "a b c", False, [[0, [[0, 1]]], [1, [[0, 1]]]], 2, "t", 0, "d", [(0, 1)], 0, "s",
                        False)], 8, k=4, same=same)
    assert [r["same_text"] for r in pq.read_table(io.BytesIO(data)).to_pylist()] == [2, 0]


def test_an_empty_partition_has_the_schema_and_no_rows() -> None:
    table = pq.read_table(io.BytesIO(write_rows([], 8)))
    assert table.schema.equals(dt.SCHEMA) and table.num_rows == 0


def test_an_offset_past_int32_is_refused() -> None:
    with pytest.raises(pa.ArrowInvalid):
        dt.pairs_array(np.array([1]), np.array([0, 1 << 31]))


def test_a_damaged_or_foreign_part_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "stats/overlap_details"
    folder.mkdir(parents=True)
    (folder / "part-00000.parquet").write_bytes(write_rows(hits(3), 8)[:-20])
    with pytest.raises(ValueError, match=r"part-00000.parquet: unreadable detail records"):
        list(dt.read_details(str(tmp_path)))
    pq.write_table(pa.table({"x": [1]}), folder / "part-00000.parquet")
    with pytest.raises(ValueError, match=r"part-00000.parquet: unreadable detail records \(its columns"):
        list(dt.read_details(str(tmp_path)))
    (tmp_path / "stats/overlap_details.jsonl.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="found parquet and jsonl"):
        list(dt.read_details(str(tmp_path)))


def test_the_readme_query_runs_on_a_decon_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "overlap_details" in b]
    parquet, _ = run_both(tmp_path)
    exec(block.replace("out/decon-loop/stats/overlap_details", str(parquet / "stats/overlap_details")), {})
    said = capsys.readouterr().out
    assert "train_snippet" in said and "GSM" in said.upper()
