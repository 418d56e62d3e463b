"""Output paths: removal never follows a symbolic link out of OUTPUT (nor swallows an error)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_prep
from refinery.transforms.core import io


@pytest.fixture
def victim(tmp_path) -> Path:
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

def test_removal_refuses_a_path_reached_through_a_link_out_of_the_root(tmp_path, victim):
    out = tmp_path / "out"
    (out / ".refinery").mkdir(parents=True)
    (out / "shard_9999").symlink_to(victim)
    (out / ".refinery" / "pack").symlink_to(victim)
    with pytest.raises(io.PathError, match=f"{out / 'shard_9999'} is a symbolic link to {victim}, outside {out}"):
        io.remove(str(out / "shard_9999" / "a-v1-shard-000000.npy"), root=str(out))
    with pytest.raises(io.PathError, match=f"{out / '.refinery' / 'pack'} is a symbolic link"):
        io.remove_tree(str(out / ".refinery" / "pack" / "sub"), root=str(out))
    assert _untouched(victim)
    with pytest.raises(io.PathError, match="not inside"):
        io.remove(str(victim / "sub" / "keep.txt"), root=str(out))


def test_removal_removes_a_link_itself_and_follows_links_that_stay_inside(tmp_path, victim):
    out = tmp_path / "out"
    (out / "real" / "x").mkdir(parents=True)
    (out / "real" / "x" / "f").write_text("x")
    (out / "inner").symlink_to(out / "real")  # stays inside OUTPUT: fine to go through
    io.remove_tree(str(out / "inner" / "x"), root=str(out))
    assert not (out / "real" / "x").exists()
    (out / ".refinery").symlink_to(victim)  # --force removing OUTPUT/.refinery: the link, not its target
    io.remove_tree(str(out / ".refinery"), root=str(out))
    assert not os.path.lexists(out / ".refinery") and _untouched(victim)
    (out / "tree").mkdir()
    (out / "tree" / "link").symlink_to(victim)  # a link inside a removed tree is removed as a link
    io.remove_tree(str(out / "tree"), root=str(out))
    assert not (out / "tree").exists() and _untouched(victim)


def test_remove_tree_raises_what_it_cannot_remove(tmp_path, monkeypatch):
    (tmp_path / "t").mkdir()

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(io.shutil, "rmtree", refuse)
    with pytest.raises(PermissionError):
        io.remove_tree(str(tmp_path / "t"), root=str(tmp_path))
    io.remove_tree(str(tmp_path / "missing"), root=str(tmp_path))  # nothing there: nothing to say


def test_prep_cleanup_never_follows_links_out_of_the_output(tmp_path, small_corpus, victim, capsys):
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
