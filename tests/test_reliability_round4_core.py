"""Hardening round 4 (issue 46), the stage machinery's own files: each is checked by content and
named when damaged, and a rerun writes it again from what it is a function of. Plan parts
(item 4), input fingerprints (F7), a lost ``repairs/<unit>`` (F8), a damaged ``created_at``
(F9); the input root in the tokenize plan (F12); ``verify`` of a missing manifest (F16)."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import gsm8k_texts, run_prep, write_jsonl
from reliability_helpers import final_digest, make_corpus, read_unit_log

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats.manifests import keep_created_at
from refinery.transforms.io import storage
from refinery.transforms.resumable import Stage, StageConfig, Traits, Unit, bind_stages, record_inputs
from refinery.transforms.resumable import unit_lists as plans

SHARDS = 3
ARGS = ("--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("round4core")
    corpus = make_corpus(root / "corpus", files=3, docs_per_file=20)
    out = root / "out"
    assert run_prep([corpus], out, *ARGS) == 0
    return corpus, out, final_digest(out)


def _copy(finished: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished[1], out)
    return out


def _verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["verify", *args])
    said = capsys.readouterr()
    return rc, said.out + said.err


def test_a_same_size_edit_of_a_plan_part_is_named_and_written_again(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 4: pack's plan part edited in place, same size ({"shard": 1} -> {"shard": 2}), and
    shard 1 deleted. Before: exit 0 with shard 1 missing (the rerun's worker read the edited
    part and wrote shard 2 under unit 0001's receipt), every rerun "nothing to do". Now:
    verify names the part, and the rerun writes it again and rebuilds shard 1."""
    corpus, _, want = finished
    out = _copy(finished, tmp_path)
    (part,) = out.glob(".refinery/pack/*/plan/part-00000.jsonl")
    text = part.read_text()
    assert text.count('{"shard": 1}') == 1
    part.write_text(text.replace('{"shard": 1}', '{"shard": 2}'))
    assert part.stat().st_size == len(text.encode())
    for f in (out / "shard_0001").iterdir():
        f.unlink()

    rc, said = _verify(capsys, str(out))
    assert rc == 1 and f"{part}: sha256 differs from" in said, said
    assert run_prep([corpus], out, *ARGS) == 0
    assert part.read_text() == text
    assert final_digest(out) == want
    assert _verify(capsys, str(out), "--checksums")[0] == 0


def test_a_worker_reads_a_plan_part_only_with_the_sha256_the_driver_wrote(tmp_path: Path) -> None:
    """Item 4, the worker's side: a part edited after the driver wrote it (same size), cut, or
    read through a reference without the parts' sha256 is refused, naming the part; the
    driver's next write_units compares by content and writes it again."""
    units = [Unit(f"{i:03d}", {"path": f"in/{i:03d}.jsonl", "shard": i % 3}) for i in range(10)]
    ref, written = plans.write_units(plans.PlanRef(str(tmp_path / "plan"), len(units)), units)
    assert written == 1 and len(ref.sha256) == 1 and plans.read_units(ref) == units
    assert plans.write_units(plans.PlanRef(ref.folder, len(units)), units) == (ref, 0)  # same bytes: not written
    part = Path(ref.part_path(0))
    good = part.read_bytes()
    part.write_bytes(good.replace(b'"shard": 1', b'"shard": 2', 1))
    with pytest.raises(ValueError, match=rf"{part}: sha256 .* not that of the part the driver wrote"):
        plans.read_part(ref, 0)
    assert plans.check_parts(ref.folder) == [f"{part}: sha256 differs from {tmp_path / 'plan' / 'index.json'}: "
                                             "a damaged plan part (the next run writes it again)"]
    with pytest.raises(ValueError, match=f"{part}: the job's plan reference has no sha256"):
        plans.read_part(plans.PlanRef(ref.folder, len(units)), 0)
    assert plans.write_units(plans.PlanRef(ref.folder, len(units)), units) == (ref, 1)
    assert part.read_bytes() == good and plans.read_units(ref) == units and plans.check_parts(ref.folder) == []
    part.write_bytes(good[:-9])
    with pytest.raises(ValueError, match=f"{part}: sha256"):
        plans.read_part(ref, 0)


class _Listed(Stage[dict[str, Any], dict[str, Any]]):
    """A stage whose input list is left out of the job: a worker reads the recorded fingerprints."""

    name = "listed"

    def __init__(self, files: list[dict[str, Any]]) -> None:
        self.files = files

    def traits(self) -> Traits:
        return Traits(driver_only=("files",))

    def config(self) -> StageConfig:
        return StageConfig({}, self._inputs())

    def _inputs(self) -> list[Any]:
        return self.files

    def make_plan(self) -> list[Unit[dict[str, Any]]]:
        return [Unit("0", {})]


def test_damaged_input_fingerprints_are_named_refused_and_written_again(tmp_path: Path) -> None:
    """F7: the recorded input fingerprints edited (a size, same length) or cut. Before: a
    worker read wrong sizes (decon's train_files.jsonl), or a JSONDecodeError not naming the
    file, forever (the driver wrote the file only when absent). Now: the worker refuses it
    naming the file, verify names it, and the driver's next record writes it again."""
    files = [{"path": f"/data/{i}.jsonl", "size": 1000 + i, "version": "1.5"} for i in range(3)]
    out = str(tmp_path / "out")
    (run,) = bind_stages([_Listed(files)], out)
    record_inputs(run, files)
    worker = pickle.loads(pickle.dumps(run))
    assert worker.input_fingerprints() == files
    (path,) = (tmp_path / "out" / ".refinery" / "fingerprints").iterdir()
    good = path.read_bytes()
    entry: Any = {"name": run.name, "stage_hash": run.stage_hash, "units": 1, "inputs_hash": run.inputs_hash}
    from refinery.transforms.resumable import ledger as stage_module
    from refinery.transforms.resumable.ledger import recorded_plan_problems

    for damaged, said in ((good.replace(b"1001", b"9001"), "not the input fingerprints of"),
                          (good[:len(good) // 2], "not valid JSON")):
        path.write_bytes(damaged)
        stage_module._recorded_fingerprints.cache_clear()  # a fresh worker process
        worker = pickle.loads(pickle.dumps(run))
        with pytest.raises(ValueError, match=f"{path}: {said}"):
            worker.input_fingerprints()
        (problem,) = recorded_plan_problems(out, entry)
        assert problem.startswith(f"{path}: {said}"), problem
        record_inputs(run, files)
        assert path.read_bytes() == good and recorded_plan_problems(out, entry) == []


def test_verify_names_edited_fingerprints_of_a_prep_run_and_the_rerun_writes_them_again(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """F7 on a prep output: `verify --checksums` said OK over edited fingerprints; now it names
    them, and a rerun (nothing to do otherwise) writes them again."""
    corpus, _, want = finished
    out = _copy(finished, tmp_path)
    (path,) = out.glob(".refinery/fingerprints/tokenize-*.json")
    good = path.read_text()
    size = str(json.loads(good)[0]["size"])
    path.write_text(good.replace(f'"size": {size}', f'"size": {int(size) + 1}', 1))
    rc, said = _verify(capsys, str(out), "--checksums")
    assert rc == 1 and f"{path}: not the input fingerprints of plan" in said, said
    assert run_prep([corpus], out, *ARGS) == 0
    assert path.read_text() == good and final_digest(out) == want
    assert _verify(capsys, str(out), "--checksums")[0] == 0


def test_a_lost_repairs_record_is_recorded_again_by_the_rerun(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """F8: a spill cut and repaired (its receipt and `repairs/00001` get a repair token), then
    `repairs/00001` deleted. Before: the rerun rebuilt pack and the manifest judged against no
    repair, and verify named their receipts "built before a repair" forever. Now: the rerun
    records the token again from the receipt, rebuilds nothing, and verify is OK."""
    corpus, _, want = finished
    out = _copy(finished, tmp_path)
    (spill,) = out.glob(".refinery/tokenize/*/parts/00001.spill")
    spill.write_bytes(spill.read_bytes()[:-5])
    assert run_prep([corpus], out, *ARGS, "--verify-checksums") == 0
    (repair,) = out.glob(".refinery/tokenize/*/repairs/00001")
    token = repair.read_bytes()
    repair.unlink()
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert run_prep([corpus], out, *ARGS) == 0
    assert [e for e in read_unit_log(log) if e["event"] == "start"] == []
    assert repair.read_bytes() == token
    rc, said = _verify(capsys, str(out), "--checksums")
    assert rc == 0, said
    assert run_prep([corpus], out, *ARGS) == 0 and final_digest(out) == want
    assert _verify(capsys, str(out), "--checksums")[0] == 0


def test_a_damaged_created_at_is_recorded_again_not_a_crash(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """F9: non-UTF-8 bytes in the manifest plan's `created_at`. Before: UnicodeDecodeError,
    not naming the file, on every run that writes the manifest. Now: a warning naming it,
    a new time recorded, the manifest written."""
    path = tmp_path / "created_at"
    path.write_bytes(b"\xff\xfe2024")
    with caplog.at_level("WARNING", logger="refinery"):
        now = keep_created_at(str(path))
    assert f"{path}: not a UTC time" in caplog.text
    assert path.read_text() == now and keep_created_at(str(path)) == now
    path.write_text("2024-01-02T03:04:05Z\n")
    assert keep_created_at(str(path)) == "2024-01-02T03:04:05Z"

    corpus, _, want = finished
    out = _copy(finished, tmp_path)
    (created,) = out.glob(".refinery/manifest/*/created_at")
    created.write_bytes(b"\x80\x81\x82")
    (out / "manifest.json").unlink()
    assert run_prep([corpus], out, *ARGS) == 0
    assert json.loads((out / "manifest.json").read_text())["created_at"] == created.read_text()
    assert final_digest(out) == want


def test_the_same_files_under_another_input_root_are_another_plan(tmp_path: Path) -> None:
    """F12: rows without ids are `relpath:row`, so `--input nested` and `--input nested/sub`
    (the same files) are different documents. Before: the tokenize hash did not hold the
    relpaths, so the second run into the first's output reused its units ("nothing to do")
    and its shards matched neither run. Now: it plans again and equals a fresh run."""
    texts = gsm8k_texts(60)
    for k in range(3):
        write_jsonl(tmp_path / "nested" / "sub" / f"p{k}.jsonl", [{"text": t} for t in texts[k * 20:(k + 1) * 20]])
    nested, sub = tmp_path / "nested", tmp_path / "nested" / "sub"
    assert run_prep([nested], tmp_path / "a", *ARGS) == 0
    assert run_prep([sub], tmp_path / "fresh", *ARGS) == 0
    assert final_digest(tmp_path / "a") != final_digest(tmp_path / "fresh")  # other ids: other shards
    assert run_prep([sub], tmp_path / "a", *ARGS) == 0
    assert final_digest(tmp_path / "a") == final_digest(tmp_path / "fresh")


def test_flat_inputs_keep_their_tokenize_hash() -> None:
    """F12 keeps the hashes of plans whose relpaths are their files' names (a flat folder,
    files named directly): only a nested input root enters the tokenize config."""
    from refinery.transforms.prep.stages import PrepConfig, TokenizeStage

    def config(relpaths: list[str]) -> dict[str, Any]:
        files = [storage.InputFile(f"/d/x/{r}", r, 10, "1") for r in relpaths]
        return dict(TokenizeStage(PrepConfig(inputs=files, output="/o", dataset="c")).config().settings)

    assert "relpaths" not in config(["a.jsonl", "b.jsonl"])
    assert config(["x/a.jsonl"])["relpaths"] != config(["a.jsonl"]).get("relpaths")


def test_verify_of_a_missing_manifest_says_so_and_what_its_folder_holds(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """F16: `verify OUT/manifest.json` with the manifest missing looked for
    `OUT/manifest.json/.refinery/run.json`. Now one line names the manifest as missing and
    says whether OUT holds an unfinished run."""
    out = _copy(finished, tmp_path)
    (out / "manifest.json").unlink()
    rc, said = _verify(capsys, str(out / "manifest.json"))
    assert rc == 1 and said.count("\n") == 1, said
    assert said.startswith(f"refinery verify: {out / 'manifest.json'}: missing; {out} holds an unfinished or "
                           "damaged refinery prep run ("), said
    assert "manifest.json/.refinery" not in said
    rc, said = _verify(capsys, str(tmp_path / "empty" / "manifest.json"))
    assert rc == 2 and said == (f"refinery verify: {tmp_path / 'empty' / 'manifest.json'}: missing, and "
                                f"{tmp_path / 'empty'} holds no refinery run (no "
                                f"{tmp_path / 'empty' / '.refinery' / 'run.json'})\n"), said
