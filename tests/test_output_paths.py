"""Output paths: removal never follows a symbolic link out of OUTPUT (nor swallows an error); an
output inside an input folder, under a file or where no folder can be made is one line, exit 2,
before anything is written, for every command that takes --output."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import storage


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside every output, with files a cleanup would take for its own."""
    v = tmp_path / "victim"
    (v / "sub").mkdir(parents=True)
    for name in ("a-v1-shard-000000.npy", "a-v1-shard-000000.idx", "sub/keep.txt"):
        (v / name).write_text("precious")
    return v


def _untouched(victim: Path) -> bool:
    return sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == \
        ["a-v1-shard-000000.idx", "a-v1-shard-000000.npy", "sub", "sub/keep.txt"]


# --- removal ------------------------------------------------------------------------------

def test_removal_refuses_a_path_reached_through_a_link_out_of_the_root(tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    (out / ".refinery").mkdir(parents=True)
    (out / "shard_9999").symlink_to(victim)
    (out / ".refinery" / "pack").symlink_to(victim)
    with pytest.raises(storage.PathError, match=f"{out / 'shard_9999'} is a symbolic link to {victim}, outside {out}"):
        storage.remove(str(out / "shard_9999" / "a-v1-shard-000000.npy"), root=str(out))
    with pytest.raises(storage.PathError, match=f"{out / '.refinery' / 'pack'} is a symbolic link"):
        storage.remove_tree(str(out / ".refinery" / "pack" / "sub"), root=str(out))
    assert _untouched(victim)
    with pytest.raises(storage.PathError, match="not inside"):
        storage.remove(str(victim / "sub" / "keep.txt"), root=str(out))


def test_removal_removes_a_link_itself_and_follows_links_that_stay_inside(tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    (out / "real" / "x").mkdir(parents=True)
    (out / "real" / "x" / "f").write_text("x")
    (out / "inner").symlink_to(out / "real")  # stays inside OUTPUT: fine to go through
    storage.remove_tree(str(out / "inner" / "x"), root=str(out))
    assert not (out / "real" / "x").exists()
    (out / ".refinery").symlink_to(victim)  # --force removing OUTPUT/.refinery: the link, not its target
    storage.remove_tree(str(out / ".refinery"), root=str(out))
    assert not os.path.lexists(out / ".refinery") and _untouched(victim)
    (out / "tree").mkdir()
    (out / "tree" / "link").symlink_to(victim)  # a link inside a removed tree is removed as a link
    storage.remove_tree(str(out / "tree"), root=str(out))
    assert not (out / "tree").exists() and _untouched(victim)


def test_remove_tree_raises_what_it_cannot_remove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t").mkdir()

    def refuse(path: str, *a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil, "rmtree", refuse)  # the module storage.outputs removes with
    with pytest.raises(PermissionError):
        storage.remove_tree(str(tmp_path / "t"), root=str(tmp_path))
    storage.remove_tree(str(tmp_path / "missing"), root=str(tmp_path))  # nothing there: nothing to say


def test_prep_cleanup_never_follows_links_out_of_the_output(
        tmp_path: Path, small_corpus: Path, victim: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 1, "--dataset", "a") == 0
    # a shard folder of "an earlier plan" that is a link: its files are not deleted, the link is named
    (out / "shard_9999").symlink_to(victim)
    capsys.readouterr()
    assert run_prep([small_corpus], out, "--num-shards", 1, "--dataset", "b") == 1
    assert f"{out / 'shard_9999'} is a symbolic link to {victim}" in capsys.readouterr().err
    assert _untouched(victim)
    (out / "shard_9999").unlink()
    # .refinery/pack a link: the other plans' folders "in it" are the victim's folders
    (out / ".refinery" / "pack").rename(victim / "pack")
    (out / ".refinery" / "pack").symlink_to(victim)
    assert run_prep([small_corpus], out, "--num-shards", 2, "--dataset", "b") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("refinery prep: refusing to remove") and f"{out / '.refinery' / 'pack'} is a symbolic " \
        "link" in line
    assert (victim / "sub" / "keep.txt").exists() and (victim / "pack").is_dir()
    (out / ".refinery" / "pack").unlink()
    # .refinery a link: --force removes the link (a fresh run), never what it points to
    (out / ".refinery").rename(victim / "meta")
    (out / ".refinery").symlink_to(victim / "meta")
    before = sorted(str(p.relative_to(victim)) for p in victim.rglob("*"))
    assert run_prep([small_corpus], out, "--num-shards", 1, "--dataset", "b", "--force") == 0
    assert not (out / ".refinery").is_symlink() and (out / ".refinery" / "run.json").exists()
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == before


# --- where the output may be ----------------------------------------------------------------

@pytest.mark.parametrize("arg, folder, reaches", [
    ("d", "d/out", True), ("d", "d", True), ("d/", "d/out/x", True), ("d", "dd/out", False),
    ("d/a.jsonl", "d", False), ("d/*.jsonl", "d/out", False), ("d/*.jsonl", "d", True),
    ("d/o*/x.jsonl", "d/out", True), ("d/p*/x.jsonl", "d/out", False), ("d/**/*.jsonl", "d/out/deep", True),
    ("gs://b/d", "gs://b/d/out", True), ("gcs://b/d/", "gs://b/d/out", True), ("gs://b/d", "gs://b/dd", False),
    ("gs://b/*.jsonl", "gs://b/out", False), ("gs://b/d", "d/out", False),
])
def test_listing_reaches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arg: str, folder: str, reaches: bool) -> None:
    monkeypatch.chdir(tmp_path)
    assert storage.listing_reaches(arg, folder) is reaches


def test_listing_reaches_through_links(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "d")
    assert storage.listing_reaches(str(tmp_path / "alias"), str(tmp_path / "d" / "out"))


def test_output_inside_an_input_folder_is_refused_before_anything_is_written(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from refinery.transforms.io import gcs

    monkeypatch.setattr(gcs, "credentials_problem", lambda: None)  # as if this machine had them
    out = small_corpus / "out"
    assert run_prep([small_corpus], out) == 2
    line = _one_line(capsys)
    assert f"--output {out} is inside the input {small_corpus}" in line and not out.exists()
    assert main(["decon", "--eval", str(tmp_path / "eval.jsonl"), "--train", str(small_corpus),
                 "--output", str(out)]) == 2
    assert f"--output {out} is inside the input {small_corpus}" in _one_line(capsys) and not out.exists()
    for command in (["prep", "--input", "gs://my-bucket/corpus"],
                    ["decon", "--eval", "gs://my-bucket/e.jsonl", "--train", "gs://my-bucket/corpus"]):
        assert main([*command, "--output", "gs://my-bucket/corpus/out"]) == 2  # refused before any request
        assert "--output gs://my-bucket/corpus/out is inside the input gs://my-bucket/corpus" in _one_line(capsys)
    # a glob that cannot descend into the output is fine
    assert run_prep([f"{small_corpus}/*.jsonl"], out, "--num-shards", 1, "--dry-run") == 0


def test_prep_mixture_output_inside_a_source_folder_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": "one two three"}])
    cfg = tmp_path / "mix.toml"
    cfg.write_text('data_root = "corpus/data"\n[flows.tiny]\ntotal_tokens_b = 0.000004\n[mixtures.pretrain]\n'
                   '[[mixtures.pretrain.sources]]\nid = "alpha"\npercent = 100.0\npath = "corpus"\n')
    assert main(["prep-mixture", "--config", str(cfg), "--flow", "tiny", "--splits", "train"]) == 2
    line = _one_line(capsys)
    assert f"the output of alpha/train {tmp_path}/corpus/data/alpha/train is inside the input {tmp_path}/corpus" \
        in line and not (tmp_path / "corpus" / "data").exists()


BAD_OUTPUTS = [("file.txt/sub", "file.txt is a file, not a folder"),
               ("file.txt", "is a file; give a folder")]
if sys.platform.startswith("linux"):
    BAD_OUTPUTS.append(("/proc/nope", "cannot create a folder in /proc"))


@pytest.mark.parametrize("output, says", BAD_OUTPUTS)
def test_bad_output_paths_are_one_line_for_every_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_corpus: Path, capsys: pytest.CaptureFixture[str],
        output: str, says: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    commands = [["prep", "--input", str(small_corpus)], ["decon", "--eval", str(small_corpus), "--train",
                                                          str(small_corpus)],
                ["generate", "--checkpoint", "ckpt", "--input", str(small_corpus)],
                ["hydra", "slices", "--data-root", "d"], ["hydra", "calibrate", "--labels", "l.jsonl"],
                ["hydra", "train", "probe", "--checkpoint", "c", "--labels", "l.jsonl", "--data-root", "d"],
                ["hydra", "oracle-label", "--checkpoint", "c", "--input-docids", "i", "--data-root", "d"],
                ["hydra", "grade", "--checkpoint", "c", "--heads-dir", "h", "--calibration", "c",
                 "--input-docids", "i", "--data-root", "d"]]
    for command in commands:
        assert main([*command, "--output", output]) == 2, command
        line = _one_line(capsys)
        assert line.startswith(f"refinery {' '.join(command[:2 if command[0] == 'hydra' else 1])}") and \
            f"--output {output}" in line and says in line, (command, line)


def test_bad_prep_mixture_data_root_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": "one two three"}])
    (tmp_path / "file.txt").write_text("x")
    cfg = tmp_path / "mix.toml"
    cfg.write_text('[flows.tiny]\ntotal_tokens_b = 0.000004\n[mixtures.pretrain]\n'
                   '[[mixtures.pretrain.sources]]\nid = "alpha"\npercent = 100.0\npath = "corpus/a.jsonl"\n')
    assert main(["prep-mixture", "--config", str(cfg), "--flow", "tiny", "--splits", "train",
                 "--data-root", str(tmp_path / "file.txt" / "sub")]) == 2
    assert f"{tmp_path / 'file.txt'} is a file, not a folder" in _one_line(capsys)


def test_check_output_writes_nothing_on_a_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from refinery.beam_pipelines.checks import UsageError, check_output

    made: list[dict[str, object]] = []

    def mkdtemp(**k: object) -> str:
        made.append(k)
        return str(tmp_path / "probe")

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)  # the module storage.outputs makes folders with
    check_output("prep", str(tmp_path / "new" / "out"), dry_run=True)
    assert made == []
    with pytest.raises(UsageError, match="is inside the input"):
        check_output("prep", str(tmp_path / "in" / "out"), [str(tmp_path / "in")], dry_run=True)


def test_prep_refuses_an_output_inside_or_holding_another_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: prep wrote a run inside another (the README's out/ and out/gsm8k), and a reader
    of the outer folder took both for one."""
    corpus = write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": f"row {i}"} for i in range(5)])
    assert run_prep([corpus], tmp_path / "out", "--num-shards", 1) == 0
    capsys.readouterr()
    assert run_prep([corpus], tmp_path / "out" / "gsm8k", "--num-shards", 1) == 2
    out = tmp_path / "out"
    assert _one_line(capsys) == (f"refinery prep: --output {out / 'gsm8k'} lies inside {out}, the output of another "
                                 f"run ({out / 'manifest.json'}): give a folder outside it, e.g. a sibling of it")
    assert not (tmp_path / "out" / "gsm8k").exists()
    (tmp_path / "runs").mkdir()
    (tmp_path / "out").rename(tmp_path / "runs" / "web")
    assert run_prep([corpus], tmp_path / "runs", "--num-shards", 1) == 2
    assert _one_line(capsys) == (f"refinery prep: --output {tmp_path / 'runs'} holds the output of another run below "
                                 f"it: {tmp_path / 'runs' / 'web'}; give a folder beside it (runs are siblings), or "
                                 "move that run out first")
    (tmp_path / "decon" / ".refinery").mkdir(parents=True)  # any run's record: a decon output's, say
    assert run_prep([corpus], tmp_path / "decon" / "a" / "b", "--num-shards", 1) == 2
    assert f"lies inside {tmp_path / 'decon'}, the output of another run ({tmp_path / 'decon' / '.refinery'})" \
        in _one_line(capsys)
    assert run_prep([corpus], tmp_path / "runs" / "web", "--num-shards", 1) == 0  # a rerun in place is no nesting


def test_nested_runs_are_found_within_bounds(tmp_path: Path) -> None:
    """The search below skips hidden and shard folders and stops at its bounds."""
    for rel in ("a/.refinery", "a/inner/manifest.json", "b/c/manifest.json", "d/.hidden/manifest.json",
                "shard_0000/x/manifest.json", "e/manifest.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    found = storage.folders_holding(str(tmp_path), limit=10)
    assert found == [str(tmp_path / "a"), str(tmp_path / "e"), str(tmp_path / "b" / "c")]
    assert storage.folders_holding(str(tmp_path), limit=1) == [str(tmp_path / "a")]
    assert storage.folders_holding(str(tmp_path), limit=10, max_listings=3) == [str(tmp_path / "a")]
    assert storage.runs_above(str(tmp_path / "b" / "c" / "x" / ".." / "y")) == [str(tmp_path / "b" / "c")]
