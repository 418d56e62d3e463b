"""Paths stay where they belong; caches are per user; remote shards are read by range; the repo
needs nothing outside itself."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_prep

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import shards
from refinery.transforms.formats import tiktoken_vocab as tokenizer
from refinery.transforms.formats.docids import parse_doc_id, read_doc_tokens
from refinery.transforms.io import storage
from refinery.transforms.resumable.ledger import RECEIPT_SCHEMA, check_receipt

ROOT = Path(__file__).resolve().parents[1]


# --- paths -------------------------------------------------------------------------------

@pytest.mark.parametrize("doc_id", ["x///etc/passwd.npy#s=0:e=4", "x//../other/shard.npy#s=0:e=4",
                                    "x//shard_0000/../../../secret.npy#s=0:e=4", "x//shard_0000/notes.txt#s=0:e=4",
                                    "x//gs://bucket/a.npy#s=0:e=4"])
def test_doc_ids_leaving_the_data_root_are_refused(doc_id: str) -> None:
    with pytest.raises(ValueError, match="doc id"):
        parse_doc_id(doc_id)


def test_a_bad_doc_id_is_an_error_row_naming_it(tmp_path: Path, small_corpus: Path) -> None:
    pytest.importorskip("torch")
    from engine_fixtures import write_harmony_checkpoint

    data = tmp_path / "prep"
    assert run_prep([small_corpus], data, "--num-shards", 1, "--dataset", "s") == 0
    outside = tmp_path / "outside.npy"
    np.save(outside, np.arange(10, dtype=np.uint32))
    good = "s//shard_0000/s-v1-shard-000000.npy#s=0:e=5"
    bad = "x//../outside.npy#s=0:e=5"
    (tmp_path / "ids.txt").write_text(f"{good}\n{bad}\nx///{outside}#s=0:e=5\n")
    with pytest.raises(ValueError):
        read_doc_tokens(str(data), bad)
    ckpt = write_harmony_checkpoint(tmp_path / "ckpt", num_hidden_layers=1)
    assert main(["generate", "--checkpoint", str(ckpt), "--input-docids", str(tmp_path / "ids.txt"),
                 "--data-root", str(data), "--output", str(tmp_path / "gen"), "--max-tokens", "2",
                 "--dtype", "float32", "--runner", "direct", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "gen" / "generations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [good, bad, f"x///{outside}#s=0:e=5"]
    assert "error" not in rows[0] and all("refusing path" in r["error"] and r["id"] in r["error"] for r in rows[1:])


def test_dataset_names_cannot_escape_the_output(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--input", str(small_corpus), "--output", str(tmp_path / "o"), "--dataset", "../escape"]) == 2
    assert "dataset name '../escape'" in capsys.readouterr().err
    assert not (tmp_path / "escape").exists() and not (tmp_path / "o").exists()


def test_receipts_and_manifests_naming_outside_paths_are_refused(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "secret").write_bytes(b"x" * 10)
    receipt = tmp_path / "out" / "r.json"
    receipt.parent.mkdir()
    for path in ("../secret", str(tmp_path / "secret"), "a/../../secret"):
        receipt.write_text(json.dumps({"schema": RECEIPT_SCHEMA, "stage_hash": "h", "status": "completed",
                                       "files": [{"path": path, "bytes": 10, "sha256": "x"}]}))
        c = check_receipt(str(tmp_path / "out"), str(receipt), "h")
        assert not c.done and "outside the output" in c.reason
    out = tmp_path / "prep"
    assert run_prep([small_corpus], out, "--num-shards", 1) == 0
    m = json.loads((out / "manifest.json").read_text())
    m["shards"][0]["path"] = "../secret"
    (out / "manifest.json").write_text(json.dumps(m))
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert "refusing path '../secret'" in capsys.readouterr().out


def test_checkpoint_index_naming_outside_files_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from refinery.kernels.checkpoint import checkpoint_files

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("../model.safetensors", "/etc/model.safetensors"):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
        with pytest.raises(ValueError, match="refusing weight file"):
            checkpoint_files(folder)


def test_caches_are_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    path = tokenizer.tiktoken_cache_path()
    assert path is not None and str(path).startswith(str(tmp_path / "home" / ".cache" / "refinery" / "tiktoken"))
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(path.parent)  # tiktoken and workers use the same folder
    assert tokenizer.user_cache_dir("harmony-vocab") == tmp_path / "home" / ".cache" / "refinery" / "harmony-vocab"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer.user_cache_dir("x") == tmp_path / "xdg" / "refinery" / "x"


# --- remote shards ------------------------------------------------------------------------

def test_remote_shards_are_read_by_range(tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    out = "memory://ranges/prep"
    assert run_prep([small_corpus], out, "--num-shards", 1, "--dataset", "r", runner="direct") == 0
    try:
        npy = f"{out}/shard_0000/r-v1-shard-000000.npy"
        ranges: list[tuple[int, int]] = []
        real = storage.read_range

        def read_range(p: str, a: int, b: int) -> bytes:
            ranges.append((a, b))
            return real(p, a, b)

        monkeypatch.setattr(storage, "read_range", read_range)
        reader = shards.ShardReader(npy)
        local = np.load(__import__("io").BytesIO(fsspec.filesystem("memory").cat_file("/ranges/prep/shard_0000/"
                                                                                         "r-v1-shard-000000.npy")))
        for i in (0, 5, len(reader) - 1):
            start, end = reader.index.get_document(i)
            assert reader.document(i).tolist() == local[start:end].tolist()
        assert [b - a for a, b in ranges] == [4 * (e - s) for s, e in
                                              (reader.index.get_document(i) for i in (0, 5, len(reader) - 1))]
        files = shards.TokenFiles(capacity=2)
        paths = []
        for k in range(3):
            paths.append(str(tmp_path / f"s{k}.npy"))
            np.save(paths[-1], np.arange(k + 1, dtype=np.uint32))
        for p in (*paths, paths[0]):
            assert len(files.get(p)) == int(Path(p).stem[1:]) + 1
        assert len(files._open) == 2 and list(files._open) == [paths[2], paths[0]]  # least recently used dropped
    finally:
        fsspec.filesystem("memory").rm("/ranges", recursive=True)


# --- noise --------------------------------------------------------------------------------

def test_a_folder_named_through_dotdot_lists_its_files_normalized(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--input ../data/corpus`` from a checkout: fsspec listed /home/me/refinery/../data/corpus/x,
    and prep's provenance sidecar, ``inspect --doc`` and the decon records printed that; now
    /home/me/data/corpus/x. Past a link to a folder, ``link/..`` is the target's parent: kept as typed."""
    (tmp_path / "data" / "corpus").mkdir(parents=True)
    (tmp_path / "data" / "corpus" / "a.jsonl").write_text('{"id": "a", "text": "some words here"}\n')
    (tmp_path / "refinery").mkdir()
    monkeypatch.chdir(tmp_path / "refinery")
    for arg in ("../data/corpus", "../data/corpus/*.jsonl", "./../data/corpus/"):
        [f] = storage.expand_inputs([arg])
        assert f.path == str(tmp_path / "data" / "corpus" / "a.jsonl") and f.relpath == "a.jsonl", arg
    assert main(["prep", "--input", "../data/corpus", "--output", "../out", "--num-shards", "1",
                 "--runner", "direct", "--no-progress"]) == 0
    assert main(["inspect", "--manifest", "../out/manifest.json", "--doc", "0:0"]) == 0
    assert f"source: {tmp_path}/data/corpus/a.jsonl, row 0" in capsys.readouterr().out
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "elsewhere" / "corpus").symlink_to(tmp_path / "data" / "corpus")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere" / "deep")
    [f] = storage.expand_inputs([str(tmp_path / "link" / ".." / "corpus")])  # elsewhere/corpus, not tmp/corpus
    assert f.path == str(tmp_path / "link" / ".." / "corpus" / "a.jsonl")


def test_gcsfs_bucket_type_warning_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    storage.paths._quiet_gcsfs()
    logger = logging.getLogger("gcsfs")
    with caplog.at_level(logging.WARNING, logger="gcsfs"):
        for _ in range(20):
            logger.warning("Could not determine bucket type for bucket name b1: oops, falling back to GCSFileSystem")
        logger.warning("Could not determine bucket type for bucket name b2: oops, falling back to GCSFileSystem")
        logger.warning("something else")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("bucket name b1" in m for m in messages) == 1 and sum("b2" in m for m in messages) == 1
    assert "something else" in messages


# --- the repo itself ------------------------------------------------------------------------

def test_the_repo_names_no_path_outside_itself() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    parent = str(ROOT.parent) + "/"  # e.g. a sibling folder of the checkout, as the developers had
    outside = re.compile("|".join(re.escape(p) for p in ("../" + "shared", parent)))
    hits = [f for f in files if f.endswith((".py", ".md", ".toml", ".sh", ".cfg", ".txt", "Makefile", "run"))
            and outside.search((ROOT / f).read_text(errors="replace"))]
    assert hits == []


def test_make_demo_writes_inside_the_checkout() -> None:
    dry = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert f"--output {ROOT}/out/demo" in dry
    absolute = re.findall(r"(?<![\w.])/[^\s'\"]+", dry)  # no fixed path such as /tmp/demo, wherever the clone is
    assert absolute and all(p.startswith(f"{ROOT}/") for p in absolute), absolute


def test_make_test_and_ci_fail_when_no_test_runs(tmp_path: Path) -> None:
    """A suite that collects nothing proves nothing: ``make test``'s own pytest line, run where
    there are no tests, exits 5 (not 0), and ``.ci/run`` passes a failing ``make test``'s
    status on."""
    dry = subprocess.run(["make", "--no-print-directory", "-n", "test"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    [line] = [ln for ln in dry.splitlines() if " -m pytest " in ln]
    empty = tmp_path / "empty"
    (empty / "tests").mkdir(parents=True)
    (empty / ".venv").symlink_to(Path(sys.prefix))
    ran = subprocess.run(["bash", "-c", line], cwd=empty, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 5, ran.stdout + ran.stderr  # pytest's "no tests collected"

    ci = tmp_path / "clone"
    (ci / ".ci").mkdir(parents=True)
    (ci / ".ci" / "run").write_bytes((ROOT / ".ci" / "run").read_bytes())
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "make").write_text("#!/bin/sh\nexit 5\n")
    (fake / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    assert subprocess.run(["bash", str(ci / ".ci" / "run")], env=env, timeout=60).returncode == 5


def test_make_test_fast_leaves_out_only_modules_that_exist() -> None:
    """A renamed slow module must not silently join `make test-fast`."""
    from conftest import SLOW_MODULES

    assert SLOW_MODULES and all((ROOT / "tests" / name).is_file() for name in SLOW_MODULES)
    dry = subprocess.run(["make", "--no-print-directory", "-n", "test-fast"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert '-m "not slow"' in dry


def test_an_editable_install_says_no_caution_that_does_not_apply(tmp_path: Path) -> None:
    """setuptools' "folders ... with the same name as your package" caution (a
    BuildBackendWarning in `make demo`) does not apply to this checkout and is not printed;
    the editable wheel is still built."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    copy = tmp_path / "checkout"
    for f in files:
        if f.endswith(".py") or f == "README.md":
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            (copy / f).write_bytes((ROOT / f).read_bytes())
    dist = tmp_path / "dist"
    dist.mkdir()
    built = subprocess.run([sys.executable, "-W", "default", "-c",
                            f"from setuptools import build_meta; print(build_meta.build_editable({str(dist)!r}))"],
                           cwd=copy, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    assert list(dist.glob("*.whl")) and "Editable installation" not in built.stdout + built.stderr


def test_static_tools_see_the_package_refinery_in_a_fresh_clone() -> None:
    """No folder is named ``refinery`` (setup.py maps the checkout's root to it): the committed
    link .typecheck/refinery is the checkout under that name, tracked by git as a link to ``..``,
    and mypy (mypy_path) and pyright (extraPaths) look there, with no set-up step."""
    tracked = subprocess.run(["git", "ls-files", "-s", ".typecheck/refinery"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked and tracked[0] == "120000", tracked  # a symbolic link, committed
    link = ROOT / ".typecheck" / "refinery"
    assert os.readlink(link) == ".." and (link / "transforms" / "resumable" / "ledger.py").is_file()
    assert "mypy_path = $MYPY_CONFIG_FILE_DIR/.typecheck" in (ROOT / "mypy.ini").read_text()
    assert ".typecheck" in json.loads((ROOT / "pyrightconfig.json").read_text())["extraPaths"]
