"""Hardening, round 4 (issue 46): one big eval row in bounded memory (item 5), a full disk in one
line (F10), an output inside an input through a bind mount (F11), a file planted among the
detail records (F14)."""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import subprocess
import sys
import unicodedata
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import write_jsonl
from test_decon_pipeline import make_matrix_inputs, run_cli

from refinery.beam_pipelines import checks, verify
from refinery.beam_pipelines.checks import UsageError, check_output, mount_aliases
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import compact
from refinery.transforms.decon.ngrams.normalized import tokens_with_offsets
from refinery.transforms.io.rows import Row

# ---------------------------------------------------------------------------------------
# Item 5: one big eval row
# ---------------------------------------------------------------------------------------

HOSTILE = ["The quick brown fox jumps over the lazy dog. " * 3, "İstanbul İİ is big, İ think so; the quick brown fox",
           unicodedata.normalize("NFD", "Café résumé naïve fiancée déjà vu, the quick brown fox jumps"),
           "word\u0085with\u0086c1 controls\u0087 inside the quick brown fox", "?!", "", "a b", "Short one.",
           "broken \ud800 surrogate inside an eval question", "  leading and trailing spaces  ", "x\r\ny\rz tab\there",
           "The quick brown fox jumps over the lazy dog. " * 3, "ǅungla Σίσυφος ΣΊΣΥΦΟΣ final sigma ς",
           "zero\u200bwidth joiner", "K kelvin sign, the quick brown fox"]


def hostile_rows() -> list[ng.EvalRow]:
    def read(path: str) -> Iterator[Row]:
        for i, t in enumerate(HOSTILE):
            yield i, {"text": t, "id": i}, None
    return ng.make_eval_rows(["x/ds/test.jsonl"], read, "text", "id", ng.TOKENIZERS["default"])[0]


def by_dict(rows: list[ng.EvalRow], ns: list[int], partitions: int, tokenizer: ng.WordSplitter,
            skip: Collection[int] = ()) -> dict[int, list[Any]]:
    """The records as the dict of n-grams builds them (:func:`ng.build_index`): the reference."""
    return dict(ng.partition_records(ng.build_index(rows, ns, tokenizer, skip), partitions))


def by_columns(rows: list[ng.EvalRow], ns: list[int], partitions: int, tokenizer: ng.WordSplitter,
               skip: Collection[int] = ()) -> dict[int, list[Any]]:
    built, _, _ = compact.build_records(rows, ns, tokenizer, partitions, skip, chunk=5)
    return {p: recs.to_lists() for p, recs in built.items()}


@pytest.mark.parametrize("tokenizer", sorted(ng.TOKENIZERS))
def test_the_index_in_columns_holds_the_records_of_the_dict_of_n_grams(tokenizer: str) -> None:
    rows = hostile_rows()
    tok = ng.TOKENIZERS[tokenizer]
    for ns, partitions in (([13], 4), ([1, 2, 3, 13], 3), ([2], 1)):
        for skip in ((), ng.same_text(rows).first):
            want = by_dict(rows, ns, partitions, tok, skip)
            assert by_columns(rows, ns, partitions, tok, skip) == want and want
            for recs in want.values():  # the partition files: the same bytes, read back the same
                packed = compact.pack_records(recs)
                assert packed == msgpack.packb(recs, use_bin_type=True, unicode_errors="surrogatepass")
                part = ng.load_partition(packed)
                assert part.records.to_lists() == recs
                for i, (n, gram, _, _) in enumerate(recs):  # the scan's lookup, by hash then text
                    assert part.find.get((n, gram.encode("utf-8", "surrogatepass"))) == i
                assert part.find.get((3, b"not an eval n gram")) is None
    for text in HOSTILE:  # the token starts the merge's longest match looks up, as one array
        assert compact.token_starts(tok, text).tolist() == [s for s, _ in tokens_with_offsets(tok, text)[1]]


def test_n_grams_that_share_a_hash_stay_apart_in_index_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashes cut to 3 bits: most n-grams share one with others; each keeps its own record,
    ordered by hash, then by where it first appears, as the dict of n-grams orders them."""
    rows = hostile_rows()
    real = vars(compact)["batch_all_window_hashes"]

    def few_bits(*args: Any) -> Any:
        return real(*args) & np.uint64(7)

    monkeypatch.setattr(compact, "batch_all_window_hashes", few_bits)
    monkeypatch.setattr(ng.index, "batch_all_window_hashes", few_bits)
    tok = ng.TOKENIZERS["default"]
    for ns, partitions in (([1, 2, 3, 13], 3), ([2], 2)):
        want = by_dict(rows, ns, partitions, tok)
        assert by_columns(rows, ns, partitions, tok) == want
        assert sum(map(len, want.values())) > 8 * partitions  # many records to a hash


# The five stages of refinery decon, each in a fresh process (its units, without Beam); each
# prints nothing: the test reads the process's peak RSS.
STAGE = """
import sys
from refinery.beam_pipelines import decon
from refinery.transforms.resumable import bind_stages, execute_unit
from refinery.transforms.decon.stages import build_stages
stage, argv = sys.argv[1], sys.argv[2:]
args = decon.build_parser().parse_args(argv)
run, = [r for r in bind_stages(build_stages(decon.settings_from_args(args)), args.output) if r.name == stage]
assert all(execute_unit(run, u)["status"] == "completed" for u in run.stage.plan())
"""


def stage_peaks_mb(root: Path, words: int) -> dict[str, float]:
    """Peak RSS (MB) of each decon stage's process, on one eval row of ``words`` random words
    (each a 13-gram's start) and 50 training rows that share 30 of its words each (every
    stage has work: the scan and the reduce load partitions, the merge scores the row)."""
    rnd = random.Random(0)
    text = " ".join(f"w{rnd.randrange(50_000)}" for _ in range(words)).split(" ")
    write_jsonl(root / "eval/ds/test.jsonl", [{"id": "e0", "text": " ".join(text)}])
    write_jsonl(root / "train/t.jsonl", [{"text": f"doc {j}: " + " ".join(text[j * 20:j * 20 + 30])}
                                         for j in range(50)])
    argv = ["--eval", str(root / "eval"), "--train", str(root / "train"), "--output", str(root / "out"),
            "--ngrams", "13"]
    peaks = {}
    for stage in ("eval", "index", "scan", "reduce", "merge"):
        proc = subprocess.Popen([sys.executable, "-c", STAGE, stage, *argv])
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0, stage
        peaks[stage] = usage.ru_maxrss / 1024
    return peaks


def test_one_big_eval_row_costs_each_stage_a_bounded_memory_per_n_gram(tmp_path: Path) -> None:
    """Before: about 850 bytes per eval n-gram in the index stage and in every process that
    loaded the partitions (scan, reduce: dicts and lists per n-gram), 2 KB in the audit's
    driver; a 20 MB eval row took it past 6 GB. Now: columns (:mod:`.compact`)."""
    words = 290_000  # a row of about 2 MB
    small, big = stage_peaks_mb(tmp_path / "small", 2_000), stage_peaks_mb(tmp_path / "big", words)
    per_ngram = {stage: round((big[stage] - small[stage]) * 2**20 / words) for stage in big}
    assert max(per_ngram.values()) <= BYTES_PER_NGRAM, (per_ngram, small, big)


BYTES_PER_NGRAM = 256  # measured at 5 MB and 20 MB: index ~195, scan ~165, reduce ~135, merge ~100 (before: ~850
# in the index, the scan and the reduce); the margin is for a loaded machine's noise


# ---------------------------------------------------------------------------------------
# F11: --output inside --input through a bind mount or a link
# ---------------------------------------------------------------------------------------


def test_mount_aliases_spell_a_folder_through_every_mount_of_its_filesystem(tmp_path: Path) -> None:
    (tmp_path / "view").mkdir()
    table = "\n".join([
        "21 1 8:1 / / rw - ext4 /dev/sda rw",
        f"22 21 8:1 {tmp_path}/in {tmp_path}/view rw - ext4 /dev/sda rw",
        "23 21 8:1 /my\\040data /mnt/space\\040d rw - ext4 /dev/sda rw",  # mountinfo escapes a space as \040
        "24 21 0:5 / /proc rw - proc proc rw",
    ])
    assert mount_aliases(str(tmp_path / "view" / "out"), table) == [str(tmp_path / "view" / "out"),
                                                                      str(tmp_path / "in" / "out")]
    assert mount_aliases("/mnt/space d/x", table) == ["/mnt/space d/x", "/my data/x"]
    assert mount_aliases("/proc/1", table) == ["/proc/1"]  # another filesystem: no other spelling


def test_an_output_inside_the_input_through_a_bind_mount_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: only spelled (resolved) paths were compared: a bind mount of the input folder
    elsewhere made its inside look like another folder, and the run read its own outputs."""
    (tmp_path / "in").mkdir()
    (tmp_path / "view").mkdir()  # as if: mount --bind IN VIEW
    table = tmp_path / "mountinfo"
    table.write_text(f"21 1 8:1 / / rw - ext4 /dev/sda rw\n22 21 8:1 {tmp_path}/in {tmp_path}/view rw - ext4 x rw\n")
    monkeypatch.setattr(checks, "MOUNTINFO", str(table))
    with pytest.raises(UsageError, match=f"--output {tmp_path}/view/out is inside the input {tmp_path}/in"):
        check_output("decon", str(tmp_path / "view" / "out"), [str(tmp_path / "in")], dry_run=True)
    with pytest.raises(UsageError, match="is inside the input"):  # a glob of the input reaches it too
        check_output("decon", str(tmp_path / "view" / "out"), [str(tmp_path / "in" / "**" / "*.jsonl")], dry_run=True)
    check_output("decon", str(tmp_path / "other" / "out"), [str(tmp_path / "in")], dry_run=True)  # elsewhere: fine


def test_an_output_inside_the_input_through_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "in")
    for output, inputs in ((tmp_path / "link" / "out", [tmp_path / "in"]),
                           (tmp_path / "in" / "out", [tmp_path / "link"])):
        with pytest.raises(UsageError, match="is inside the input"):
            check_output("decon", str(output), list(map(str, inputs)), dry_run=True)


@contextlib.contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[None]:
    """``mount --bind source target`` for the block; skips the test where mounting is refused
    (not root, no mount tool, a container without the capability), saying why."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mount --bind needs root and the mount tool")
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mount --bind refused here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_real_bind_mount_of_the_input_is_seen_by_device_and_inode(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "view").mkdir()
    with bind_mount(tmp_path / "in", tmp_path / "view"):
        with pytest.raises(UsageError, match="is inside the input"):
            check_output("decon", str(tmp_path / "view" / "out"), [str(tmp_path / "in")], dry_run=True)
        with pytest.raises(UsageError, match="is inside the input"):
            check_output("decon", str(tmp_path / "in" / "out"), [str(tmp_path / "view")], dry_run=True)
        # without the mount table (not Linux), the walk up the output's folders by device and inode
        monkeypatch.setattr(checks, "MOUNTINFO", str(tmp_path / "no-such-file"))
        with pytest.raises(UsageError, match="is inside the input"):
            check_output("decon", str(tmp_path / "view" / "out"), [str(tmp_path / "in")], dry_run=True)


# ---------------------------------------------------------------------------------------
# F14: a file planted among the detail records
# ---------------------------------------------------------------------------------------


def decon_verify(out: Path, *flags: str) -> int:
    """``refinery verify OUT [flags]``'s exit code (its lines on stdout)."""
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    return verify.run(parser.parse_args([str(out), *flags]), [])


def test_a_planted_detail_part_is_named_by_verify_and_removed_by_the_next_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a copy of a part beside the others was kept, verify said OK, and every reader
    of the folder read its rows twice."""
    ev, tr = make_matrix_inputs(tmp_path)
    out = tmp_path / "out"
    argv = ["--eval", ev, "--train", tr, "--output", str(out), "--ngrams", "3", "13", "--partitions", "3"]
    assert run_cli(argv) == 0
    folder = out / "stats/overlap_details"
    want = {p.name: p.read_bytes() for p in folder.iterdir()}
    shutil.copy(folder / "part-00001.parquet", folder / "part-00007.parquet")
    capsys.readouterr()
    assert decon_verify(out) == 1
    said = capsys.readouterr().out
    assert "stats/overlap_details/part-00007.parquet: not written by this run" in said
    assert run_cli(argv) == 0  # every unit done; the part of no plan goes, and the run says so
    assert "removed 1 detail part(s) not of this run's plan: stats/overlap_details/part-00007.parquet" in \
        capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == want
    assert decon_verify(out, "--checksums") == 0

    # a file of another name is not decon's to delete: the run refuses in one line, verify names it
    (folder / "mine.parquet").write_bytes(want["part-00000.parquet"])
    assert decon_verify(out) == 1
    assert "stats/overlap_details/mine.parquet: not written by this run" in capsys.readouterr().out
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{folder}/mine.parquet: not a file decon writes" in err[0], err
    assert (folder / "mine.parquet").exists()


# ---------------------------------------------------------------------------------------
# F10: a full disk
# ---------------------------------------------------------------------------------------

# refinery decon with every atomic write failing with ENOSPC once BUDGET bytes went through
# (a disk that fills up mid-run); in this process: the direct runner
FULL_DISK = """
import errno, sys
from refinery.transforms.io.storage import atomic
from refinery.beam_pipelines.cli import main
budget = [int(sys.argv[1])]
write = atomic.HashingWriter.write
def full(self, data):
    budget[0] -= len(memoryview(data).cast("B"))
    if budget[0] < 0:
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, data)
atomic.HashingWriter.write = full
sys.exit(main(["decon", *sys.argv[2:]]))
"""


def decon_on_full_disk(budget: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", FULL_DISK, str(budget), *argv], capture_output=True, text=True,
                          timeout=300)


def assert_one_line_naming_the_disk(done: subprocess.CompletedProcess[str], out: Path) -> None:
    assert done.returncode == 1, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if not ln.startswith("decon: ")]  # the header aside
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert lines[0].startswith("refinery decon: no space left on device: the disk of ") and str(out) in lines[0]
    assert "run the same command again: " in lines[0] and "--output" in lines[0]


def test_a_full_disk_ends_decon_in_one_line_naming_the_disk(tmp_path: Path) -> None:
    """Before: each failed unit's line, the runner's tracebacks (a failed unit's receipt could
    not be written either) and "RuntimeError: Traceback ..."."""
    ev, tr = make_matrix_inputs(tmp_path)
    out = tmp_path / "out"
    argv = ["--eval", ev, "--train", tr, "--output", str(out), "--ngrams", "3", "13", "--partitions", "3",
            "--runner", "direct", "--no-progress"]
    assert_one_line_naming_the_disk(decon_on_full_disk(20_000, *argv), out)
    assert run_cli(argv[:-3]) == 0  # space again: the run finishes, as a fresh one would
    fresh = tmp_path / "fresh"
    assert run_cli([*argv[:5], str(fresh), *argv[6:-3]]) == 0
    for name in ("overlap_stats.jsonl", "contaminated_train_docs.jsonl", "overlap_instances.jsonl.gz"):
        assert (out / "stats" / name).read_bytes() == (fresh / "stats" / name).read_bytes()


def test_a_real_full_disk_under_the_local_runner(tmp_path: Path) -> None:
    """A small tmpfs (root only; skipped where mounting is refused) and refinery's own runner:
    its worker processes' copies of the error are held back too."""
    ev, tr = make_matrix_inputs(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a tmpfs needs root and the mount tool")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"mount -t tmpfs refused here: {done.stderr.strip()}")
    try:
        out = disk / "out"
        argv = ["decon", "--eval", ev, "--train", tr, "--output", str(out), "--ngrams", "3", "13", "--partitions",
                "8", "--no-progress", "--workers", "2"]
        run = subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", *argv], capture_output=True,
                             text=True, timeout=300)
        assert_one_line_naming_the_disk(run, out)
        assert f"(mounted at {disk})" in run.stderr
    finally:
        subprocess.run(["umount", str(disk)], check=True)
