"""Damage to a finished prep output: ``refinery verify --checksums`` names every problem
(exit 1), and one rerun with ``--verify-checksums`` repairs exactly the affected units and
what was built from a damaged intermediate (the unit log shows which units started) back
to byte-identical outputs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from helpers import run_prep
from reliability_helpers import final_digest, make_corpus, read_unit_log, temp_files, write_figures

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import storage

SHARDS = 6


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("corruption")
    corpus = make_corpus(root / "corpus", files=4, docs_per_file=40)
    out = root / "out"
    assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0) == 0
    return corpus, out, final_digest(out)


def _paths(out: Path) -> dict[str, Callable[..., Path]]:
    run = json.loads((out / ".refinery/run.json").read_text())
    h = {s["name"]: s["stage_hash"] for s in run["stages"]}
    return {
        "npy": lambda s: next((out / f"shard_{s:04d}").glob("*.npy")),
        "idx": lambda s: next((out / f"shard_{s:04d}").glob("*.idx")),
        "receipt": lambda stage, unit: out / ".refinery" / stage / h[stage] / "receipts" / f"{unit}.json",
        "part": lambda name: out / ".refinery" / "tokenize" / h["tokenize"] / "parts" / name,
    }


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_verify_names_each_problem_and_rerun_repairs_exactly_those_units(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    corpus, original, want = finished
    out = tmp_path / "out"
    shutil.copytree(original, out)
    p = _paths(out)

    # (what was done, a text verify must print for it, the unit the rerun must redo or None)
    damage: list[tuple[str, str, tuple[str, str] | None]] = []
    npy = p["npy"](0)
    npy.write_bytes(npy.read_bytes()[:-7])
    damage.append(("truncated .npy", str(npy), ("pack", "0000")))
    p["idx"](1).unlink()
    damage.append(("deleted .idx", f"{p['idx'](2).parent.parent / 'shard_0001'}", ("pack", "0001")))
    _flip(p["npy"](2), os.path.getsize(p["npy"](2)) - 9)
    damage.append(("flipped byte in a shard", f"{p['npy'](2)}: sha256", ("pack", "0002")))
    r3 = p["receipt"]("pack", "0003")
    r3.write_bytes(r3.read_bytes()[:50])
    damage.append(("truncated receipt", f"{r3}: unreadable receipt", ("pack", "0003")))
    r4 = p["receipt"]("pack", "0004")
    other = json.loads(r4.read_text())
    other["stage_hash"] = "0" * 16
    r4.write_text(json.dumps(other))
    damage.append(("receipt from another plan", f"{r4}: receipt from another plan", ("pack", "0004")))
    _flip(p["part"]("00001.spill"), 100)
    damage.append(("flipped byte in an intermediate spill", "checksum mismatch for .refinery/tokenize",
                   ("tokenize", "00001")))
    # every shard may have been packed from the damaged spill: all are rebuilt after its repair
    built_from_spill = [("pack", f"{s:04d}") for s in range(SHARDS)] + [("manifest", "manifest")]
    host = storage.temp_name("x").split(storage.TMP_MARKER)[1].split("-")[0]
    stray = out / "shard_0005" / f".c-v1-shard-000005.npy{storage.TMP_MARKER}{host}-{_dead_pid()}-{'0123abcd' * 4}"
    stray.write_bytes(b"\x93NUMPY half a shard")
    damage.append(("stray temp file of a dead writer", f"{stray}: stray temporary file", None))
    rejects = out / "rejects" / "rejects.jsonl"
    rejects.write_bytes(rejects.read_bytes() + b"{}\n")
    damage.append(("appended line in rejects.jsonl", "size mismatch for rejects/rejects.jsonl",
                   ("manifest", "manifest")))

    capsys.readouterr()
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 1
    report = capsys.readouterr().out
    missed = [what for what, text, _ in damage if text not in report]
    assert missed == [], report

    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0, "--verify-checksums") == 0
    started = sorted((e["stage"], e["unit"]) for e in read_unit_log(log) if e["event"] == "start")
    assert started == sorted({u for _, _, u in damage if u} | set(built_from_spill))
    assert final_digest(out) == want
    assert temp_files(out) == []
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0
    write_figures("corruption", {"corruptions": len(damage), "detected": len(damage) - len(missed),
                                 "units_repaired": len(started)})


def test_spill_damaged_before_pack_is_repaired_with_every_shard_built_from_it(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """prep stopped after tokenize, a byte of a spill flipped, then a plain rerun: it cannot
    see the damage (sizes only) and packs it into a shard, but `verify --checksums` never says
    OK while that shard is there: first it names the spill, and once the spill alone is
    rebuilt, the pack receipts built before that repair. A rerun with --verify-checksums
    then rebuilds every shard packed from the spill, and the outputs equal a clean run's."""
    from refinery.transforms.prep.stages import PrepConfig, build_stages
    from refinery.transforms.resumable import bind_stages, execute_unit, run_stages

    corpus, _, want = finished
    out = tmp_path / "out"
    cfg = PrepConfig(inputs=storage.expand_inputs([str(corpus)]), output=str(out), dataset="c", num_shards=SHARDS,
                     unit_bytes=0)
    run_stages(build_stages(cfg)[:1], str(out), ["--runner=DirectRunner"], progress=False)  # killed after tokenize
    _flip(_paths(out)["part"]("00001.spill"), 100)
    assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0) == 0
    assert final_digest(out) != want  # the known limit: a plain run checks an intermediate's size only

    capsys.readouterr()
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 1
    assert "checksum mismatch for .refinery/tokenize" in capsys.readouterr().out
    tokenize = bind_stages(build_stages(cfg), str(out))[0]
    assert execute_unit(tokenize, tokenize.stage.plan()[1], verify_checksums=True)["status"] == "completed"
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 1
    report = capsys.readouterr().out
    assert all(f"pack/{_paths(out)['receipt']('pack', '0000').parent.parent.name}/receipts/{s:04d}.json: built "
               f"before a repair of tokenize/00001" in report for s in range(SHARDS)), report
    assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0, "--dry-run") == 0
    plan = {row.split()[0]: row.split()[2:] for row in capsys.readouterr().out.splitlines()[2:]}
    assert plan["pack"] == [str(SHARDS), "0", "0", str(SHARDS)] and plan["manifest"] == ["1", "0", "0", "1"], plan

    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0, "--verify-checksums") == 0
    started = sorted((e["stage"], e["unit"]) for e in read_unit_log(log) if e["event"] == "start")
    assert started == [("manifest", "manifest")] + [("pack", f"{s:04d}") for s in range(SHARDS)]
    assert final_digest(out) == want
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0


def test_plain_verify_and_rerun_catch_size_damage(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without checksums: a truncated shard and a truncated manifest are still named, and a
    plain rerun (size check) rebuilds exactly those two units."""
    corpus, original, want = finished
    out = tmp_path / "out"
    shutil.copytree(original, out)
    npy = _paths(out)["npy"](3)
    npy.write_bytes(npy.read_bytes()[:200])
    capsys.readouterr()
    assert main(["verify", str(out / "manifest.json")]) == 1
    assert str(npy) in capsys.readouterr().out
    (out / "manifest.json").write_text((out / "manifest.json").read_text()[:100])
    assert main(["verify", str(out / "manifest.json")]) == 1
    assert "manifest.json: not valid JSON" in capsys.readouterr().out
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0) == 0
    started = sorted((e["stage"], e["unit"]) for e in read_unit_log(log) if e["event"] == "start")
    assert started == [("manifest", "manifest"), ("pack", "0003")]
    assert final_digest(out) == want


def test_receipt_with_malformed_file_entries_is_pending_not_a_crash(tmp_path: Path) -> None:
    from refinery.transforms.resumable.ledger import RECEIPT_SCHEMA, check_receipt

    path = tmp_path / "r.json"
    malformed: list[list[Any]] = [[{}], [{"path": "x", "bytes": "12", "sha256": "s"}], ["x"],
                                  [{"path": 3, "bytes": 1, "sha256": ""}]]
    for files in malformed:
        path.write_text(json.dumps({"schema": RECEIPT_SCHEMA, "stage_hash": "h", "status": "completed",
                                    "files": files}))
        c = check_receipt(str(tmp_path), str(path), "h")
        assert not c.done and "malformed file entry" in c.reason


def test_which_temp_files_are_dead(tmp_path: Path) -> None:
    host = storage.temp_name("x").split(storage.TMP_MARKER)[1].split("-")[0]
    hexes = "0123456789abcdef" * 2
    live = tmp_path / f".a{storage.TMP_MARKER}{host}-{os.getpid()}-{hexes}"
    dead = tmp_path / f".b{storage.TMP_MARKER}{host}-{_dead_pid()}-{hexes}"
    other_host = tmp_path / f".c{storage.TMP_MARKER}otherhost-{_dead_pid()}-{hexes}"
    # a user's files that merely contain ".tmp-", however old: never ours, never removed or reported
    (tmp_path / "notes").mkdir()
    user_files = [tmp_path / "notes" / "draft.tmp-2024.txt", tmp_path / f".d{storage.TMP_MARKER}0123abcd",
                  tmp_path / f".e{storage.TMP_MARKER}{host}-{_dead_pid()}-00ff"]
    zombie_pid = os.fork()  # a killed Beam worker whose parent is gone: a zombie until reaped
    if zombie_pid == 0:
        os._exit(0)
    try:
        time.sleep(0.2)
        zombie = tmp_path / f".f{storage.TMP_MARKER}{host}-{zombie_pid}-{hexes}"
        for p in (live, dead, other_host, zombie, *user_files):
            p.write_bytes(b"x")
        for p in user_files:
            os.utime(p, (1, 1))
        assert storage.find_temp_files(str(tmp_path)) == sorted(str(p) for p in (live, dead, other_host, zombie))
        assert storage.remove_dead_temp_files(str(tmp_path)) == sorted([str(dead), str(zombie)])
    finally:
        os.waitpid(zombie_pid, 0)
    assert sorted(str(p) for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        str(p) for p in (live, other_host, *user_files))


def test_a_deleted_receipt_is_named_and_removed_intermediates_are_not_rebuilt(
        finished: tuple[Path, Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A deleted receipt of a final stage: `verify --checksums` names it (exit 1), and the rerun
    redoes that unit alone. `.refinery/tokenize/` removed after a finished run (the README says
    it may be): verify notes it (exit 0), a rerun runs nothing, `status` says tokenize is not
    needed; once a shard is lost, the rerun tokenizes again to rebuild it, byte-identical."""
    corpus, original, want = finished
    out = tmp_path / "out"
    shutil.copytree(original, out)
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))

    def rerun_started() -> list[tuple[str, str]]:
        log.unlink(missing_ok=True)
        assert run_prep([corpus], out, "--num-shards", SHARDS, "--dataset", "c", "--unit-mb", 0) == 0
        assert final_digest(out) == want
        return sorted((e["stage"], e["unit"]) for e in read_unit_log(log) if e["event"] == "start")

    _paths(out)["receipt"]("pack", "0002").unlink()
    capsys.readouterr()
    assert main(["verify", str(out), "--checksums"]) == 1
    assert f"stage pack: 1 of {SHARDS} planned units have no receipt" in capsys.readouterr().out
    assert rerun_started() == [("pack", "0002")]

    tokenize = _paths(out)["part"]("x").parent.parent.parent
    shutil.rmtree(tokenize)
    capsys.readouterr()
    assert main(["verify", str(out), "--checksums"]) == 0
    said = capsys.readouterr().out
    assert "NOTE stage tokenize: 4 of 4 planned units have no receipt" in said and "OK" in said
    assert rerun_started() == []
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    assert "(not needed: the stages after it are complete)" in capsys.readouterr().out

    _paths(out)["npy"](3).unlink()
    assert rerun_started() == [("pack", "0003")] + [("tokenize", f"{i:05d}") for i in range(4)]
    assert main(["verify", str(out), "--checksums"]) == 0
