"""Clean eval subsets (issue 50 item 3): ``stats/clean/<dataset>/n=<n>.jsonl.gz``, the eval rows
as read that no training row overlaps at n, and their counts in overlap_stats.jsonl and report.md."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import write_jsonl
from test_decon_pipeline import read_jsonl, run_cli
from test_decon_round4 import decon_verify

from refinery.transforms.decon.ngrams import clean as cl
from refinery.transforms.decon.ngrams.ids import record_hash_id
from refinery.transforms.decon.ngrams.index import EvalRow

Q = {  # questions of 16+ tokens, no word shared between two of them
    "full": "alice bought seven red apples at the corner market then sold three of them to her neighbour bob",
    "span": "a train leaves the station every forty minutes carrying grain north toward distant mountain towns",
    "clean": "how many golden coins did the pirate captain hide beneath twelve palm trees on sunday morning",
    "noid": "water boils faster high above sea level because air pressure drops as climbers ascend steep peaks",
    "beta_full": "the library lends ninety books each week and receives fifty new volumes from generous donors",
    "beta_clean": "zoë paints café murals with bright turquoise ochre and violet pigments during quiet evenings",
}
ALPHA: list[dict[str, Any]] = [
    {"id": "a0", "question": Q["full"], "answer": "4"},             # contaminated at 5 and 13
    {"id": "a1", "question": Q["span"], "answer": "x"},             # a 7-token span: at 5 only
    {"id": "a2", "question": Q["clean"], "answer": 12, "tags": ["m"]},
    {"question": Q["noid"], "answer": "no id", "id": None},          # id-less: its hash is its id
    {"id": "a4", "question": "who wrote it?"},                       # 3 tokens: short, not checked
    {"id": "a5", "question": "?!"},                                  # empty: not checked
    {"id": "a6", "answer": "no question"},                           # no text: a bad row, not an instance
    {"id": "a7", "question": Q["clean"]},                            # a2's text: clean as a2
]
BETA: list[dict[str, Any]] = [
    {"id": "b0", "question": Q["beta_full"], "meta": {"k": [1, 2]}},
    {"id": "b1", "question": Q["beta_clean"], "meta": {"k": None}},
]
NS = (5, 13)


def filler(i: int) -> str:
    return " ".join(f"filler{i}w{j}" for j in range(30))


def make_inputs(root: Path) -> tuple[Path, Path]:
    evals = root / "eval"
    write_jsonl(evals / "alpha" / "test.jsonl", ALPHA)
    write_jsonl(evals / "beta" / "test.jsonl", BETA)
    span = " ".join(Q["span"].split()[3:10])  # 7 tokens of a1: a 5-gram, no 13-gram
    train = [{"id": f"t{i}", "text": t} for i, t in enumerate([
        filler(0), f"{filler(1)} {Q['full']} {filler(2)}", f"{filler(3)} {span} {filler(4)}",
        Q["beta_full"].upper(), filler(5)])]
    write_jsonl(root / "train" / "part.jsonl", train)
    return evals, root / "train"


def decon(root: Path, out: Path) -> int:
    evals, train = make_inputs(root)
    return int(run_cli(["--eval", str(evals), "--train", str(train), "--output", str(out), "--eval-text-field",
                        "question", "--ngrams", *map(str, NS), "--partitions", "3"]))


def read_gz_lines(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rb") as f:
        return [json.loads(line) for line in f]


def clean_files(out: Path) -> dict[str, bytes]:
    folder = out / "stats" / "clean"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clean")
    assert decon(root, root / "out") == 0
    return root


def test_clean_subsets_are_the_rows_no_training_row_overlaps_at_each_n(run: Path) -> None:
    out = run / "out"
    noid = record_hash_id(ALPHA[3])
    want = {("alpha", 5): [ALPHA[2], {**ALPHA[3], "instance_id": noid}, ALPHA[7]],
            ("alpha", 13): [ALPHA[1], ALPHA[2], {**ALPHA[3], "instance_id": noid}, ALPHA[7]],
            ("beta", 5): [BETA[1]], ("beta", 13): [BETA[1]]}
    assert set(clean_files(out)) == {f"stats/clean/{ds}/n={n}.jsonl.gz" for ds, n in want}
    for (ds, n), rows in want.items():
        got = read_gz_lines(out / cl.clean_file(ds, n))
        assert got == rows, (ds, n)  # as read: every field, in file order (the id-less row with its id)
        assert [list(r) for r in got] == [list(r) for r in rows]  # the keys in the file's order
    stats = {(s["eval_dataset"], s["n"]): s for s in read_jsonl(str(out / "stats/overlap_stats.jsonl"))}
    assert set(stats) == set(want)
    for key, s in stats.items():
        ids = {r.get("id") or r.get("instance_id") for r in want[key]}
        # the clean ids, the overlapping ones and those never checked (short, empty) split the instances
        assert s["num_clean_instances"] == len(ids) and s["num_clean_rows"] == len(want[key])
        assert not ids & set(s["instance_ids"]) and not ids & set(s["short_instance_ids"])
        assert s["num_clean_instances"] + len(s["instance_ids"]) + s["num_unchecked_instances"] == s["num_instances"]
    assert stats[("alpha", 5)]["instance_ids"] == ["a0", "a1"] and stats[("alpha", 13)]["instance_ids"] == ["a0"]
    assert stats[("alpha", 5)]["num_unchecked_instances"] == 2 and stats[("alpha", 5)]["num_instances"] == 7
    assert stats[("beta", 13)]["instance_ids"] == ["b0"]
    report = (out / "stats/report.md").read_text()
    assert "alpha 3 at n = 5, alpha 4 at n = 13, beta 1 at n = 5, beta 1 at n = 13" in report


def test_clean_subsets_are_the_same_bytes_on_a_rerun_and_in_the_receipt(run: Path, tmp_path: Path) -> None:
    out = run / "out"
    before = clean_files(out)
    assert decon(run, out) == 0 and clean_files(out) == before  # a rerun: nothing changes
    assert decon(tmp_path, tmp_path / "out") == 0
    assert clean_files(tmp_path / "out") == before  # another run from scratch: the same bytes
    for data in before.values():
        assert data[4:8] == b"\0\0\0\0" and not data[3] & 0x08  # gzip: mtime 0, no file name
    receipts = [json.loads(p.read_text()) for p in (out / ".refinery").rglob("receipts/merge.json")]
    listed = {f["path"] for r in receipts for f in r["files"]}
    assert set(before) <= listed  # verify checks them as the merge's other files


def test_a_clean_file_of_another_run_is_removed_and_another_file_kept(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert decon(tmp_path, out) == 0
    stale, foreign = out / "stats/clean/gone/n=5.jsonl.gz", out / "stats/clean/alpha/notes.txt"
    stale.parent.mkdir()
    stale.write_bytes(b"x")
    foreign.write_bytes(b"mine")
    removed = cl.remove_stale_clean(str(out), set(clean_files(out)) - {"stats/clean/gone/n=5.jsonl.gz"})
    assert removed == ["stats/clean/gone/n=5.jsonl.gz"] and not stale.parent.exists() and foreign.exists()


def test_verify_names_an_edited_clean_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert decon(tmp_path, out) == 0 and decon_verify(out, "--checksums") == 0
    path = out / cl.clean_file("beta", 13)
    path.write_bytes(gzip.compress(b'{"id": "b0"}\n', mtime=0))
    capsys.readouterr()
    assert decon_verify(out, "--checksums") == 1
    assert "stats/clean/beta/n=13.jsonl.gz" in capsys.readouterr().out


def row(i: int, path: str, eval_row: int, instance_id: str, hashed: bool = False, ds: str = "d") -> EvalRow:
    return EvalRow(i, ds, path, eval_row, instance_id, "some text here", 3, False, hashed)


def test_an_eval_file_changed_since_the_index_is_named_not_written() -> None:
    rows = [row(0, "e.jsonl", 0, "x"), row(1, "e.jsonl", 2, "y")]
    good = [(0, {"id": "x"}, None), (1, None, "bad"), (2, {"id": "y"}, None)]
    assert [r.instance_id for r, _ in cl.rows_as_read(rows, lambda p: iter(good), "id")] == ["x", "y"]
    with pytest.raises(ValueError, match=r"e.jsonl row 2: not the row decon indexed .*'z'"):
        list(cl.rows_as_read(rows, lambda p: iter([*good[:2], (2, {"id": "z"}, None)]), "id"))
    with pytest.raises(ValueError, match=r"e.jsonl row 2: not found again"):
        list(cl.rows_as_read(rows, lambda p: iter(good[:2]), "id"))


def test_an_id_less_row_with_an_instance_id_field_of_its_own_is_refused() -> None:
    record = {"text": "t", "instance_id": "theirs"}
    with pytest.raises(ValueError, match=r"e.jsonl row 4: has no id .*--id-field"):
        cl.clean_line(record, row(0, "e.jsonl", 4, record_hash_id(record), hashed=True))
    assert json.loads(cl.clean_line({"id": 3, "t": "é"}, row(0, "e.jsonl", 0, "3"))) == {"id": 3, "t": "é"}


def test_a_dataset_name_is_one_folder_name() -> None:
    assert cl.clean_file("gsm8k", 13) == "stats/clean/gsm8k/n=13.jsonl.gz"
    assert cl.clean_dir_name("a/b\\c%d\n") == "a%2Fb%5Cc%25d%0A"
    assert [cl.clean_dir_name(x) for x in ("", ".", "..", "a.b")] == ["%2E", "%2E", "%2E%2E", "a.b"]
    assert os.sep not in cl.clean_dir_name("../x")
