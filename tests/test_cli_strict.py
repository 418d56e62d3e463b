"""A strict, friendly CLI: typos, wrong fields and everyday mistakes are one clear line and exit 2;
--dry-run on every pipeline command; status by the one completion check; quiet progress off a terminal."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import gsm8k_texts, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
from engine_fixtures import write_harmony_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_harmony_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=2))


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("argv, bad, hint", [
    (["prep", "--input", "x", "--output", "y", "--nmu-shards", "4"], "--nmu-shards", "--num-shards"),
    (["prep", "--input", "x", "--ouput", "y", "--output", "z"], "--ouput", "--output"),
    (["decon", "--eval", "e", "--train", "t", "--output", "o", "--ngarms", "5"], "--ngarms", "--ngrams"),
    (["generate", "--checkpoint", "c", "--input", "i", "--output", "o", "--temprature", "0.5"], "--temprature",
     "--temperature"),
    (["hydra", "grade", "--checkpoint", "c", "--heads-dir", "h", "--calibration", "c", "--input-docids", "d",
      "--output", "o", "--max-ctxx", "5"], "--max-ctxx", "--max-ctx"),
])
def test_unknown_flags_exit_2_with_the_nearest_flag(argv: list[str], bad: str, hint: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    line = _one_line(capsys)
    assert f"unknown option {bad}" in line and f"did you mean {hint}?" in line


def test_the_recorded_beam_flags_are_the_installed_beams() -> None:
    """The flag check reads Beam's flags from a record (no ``import apache_beam``): the record
    must be the installed Beam's, or a flag Beam added would be refused, one it dropped passed."""
    from refinery.beam_pipelines import beam_flag_names
    from refinery.beam_pipelines.beam_flags import installed_beam_version, live_beam_flags

    assert beam_flag_names.BEAM_VERSION == installed_beam_version(), \
        "run `python -m refinery.beam_pipelines.beam_flags --write` for the installed Beam"
    assert frozenset(beam_flag_names.FLAGS) == live_beam_flags()


def test_a_flag_error_is_answered_before_beam_is_imported(tmp_path: Path, small_corpus: Path) -> None:
    """`refinery prep ... --bad-flag` and `--help` answer without importing Beam (which takes
    1.5-2 s, 5-11 s under load): the process ends with apache_beam never imported."""
    probe = ("import sys\nfrom refinery.beam_pipelines.cli import main\n"
             "rc = main(sys.argv[1:])\nprint('BEAM' if 'apache_beam' in sys.modules else 'NO-BEAM', rc)\n")
    argv = ["prep", "--input", str(small_corpus), "--output", str(tmp_path / "o"), "--nmu-shards", "4"]
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["NO-BEAM", "2"] and "did you mean --num-shards?" in done.stderr, done
    helped = subprocess.run([sys.executable, "-c", "import sys\nfrom refinery.beam_pipelines.cli import main\n"
                             "try:\n    main(['prep', '--help'])\nexcept SystemExit:\n"
                             "    print('BEAM' if 'apache_beam' in sys.modules else 'NO-BEAM')\n"],
                            capture_output=True, text=True, timeout=60)
    assert helped.stdout.splitlines()[-1] == "NO-BEAM", helped.stderr


def test_real_beam_flags_still_pass(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--input", str(small_corpus), "--output", str(tmp_path / "o"), "--job_name=nightly-prep",
                 "--temp_location", str(tmp_path / "tmp"), "--dry-run"]) == 0
    assert "tokenize" in capsys.readouterr().out and not (tmp_path / "o").exists()


def test_a_missing_text_field_lists_the_fields_the_rows_have(tmp_path: Path, small_corpus: Path,
                                                             capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    assert main(["prep", "--input", str(small_corpus), "--output", str(tmp_path / "p"), "--text-field", "nosuch"]) == 2
    line = _one_line(capsys)
    assert "--text-field 'nosuch'" in line and "their fields: id, text" in line and not (tmp_path / "p").exists()
    write_jsonl(tmp_path / "ev" / "e.jsonl", [{"id": "1", "question": "q"}])
    assert main(["decon", "--eval", str(tmp_path / "ev"), "--train", str(small_corpus),
                 "--output", str(tmp_path / "d")]) == 2
    assert "--eval-text-field 'text'" in _one_line(capsys)
    assert main(["generate", "--checkpoint", ckpt, "--input", str(small_corpus), "--text-field", "body",
                 "--output", str(tmp_path / "g")]) == 2
    assert "--text-field 'body'" in _one_line(capsys)


def test_mostly_rejected_rows_are_said_loudly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "c" / "a.jsonl", [{"text": "good one"}] + [{"text": 3}] * 5)
    assert run_prep([tmp_path / "c"], tmp_path / "o") == 0
    err = capsys.readouterr().err
    assert "WARNING refinery prep: 5 of 6 rows (83%) were rejected" in err


def test_prep_names_skipped_files_and_reads_extensions_in_any_case(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "c"
    write_jsonl(d / "a.jsonl", [{"text": "alpha one"}, {"text": "alpha two"}])
    write_jsonl(d / "c.JSONL", [{"text": "upper case name"}])
    (d / "b.jsonl.bz2").write_bytes(b"BZh9")
    (d / "readme.txt").write_text("notes")
    assert run_prep([d], tmp_path / "o") == 0
    assert f"skipped 2 file(s) with unsupported extensions: {d}/b.jsonl.bz2, {d}/readme.txt" in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["rows"]["read"] == 3


def test_a_run_that_accepts_nothing_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """All rows rejected, or none read: exit 1 with one line saying why (also when the rerun has
    nothing left to do); --max-reject-rate tunes it."""
    write_jsonl(tmp_path / "bad" / "a.jsonl", [{"text": 3}] * 3)
    for _ in range(2):  # the first run, then a rerun that finds every unit done
        assert run_prep([tmp_path / "bad"], tmp_path / "o") == 1
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == (f"refinery prep: no rows accepted of 3 read (3 rejected; reasons in {tmp_path}/o/rejects/"
                        f"rejects.jsonl); --max-reject-rate 1 lets such a run pass")
        assert not (tmp_path / "o" / "manifest.json").exists()  # nothing accepted: no manifest to mistake for data
    assert run_prep([tmp_path / "bad"], tmp_path / "o", "--max-reject-rate", "1") == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "o")]) == 1  # allowed to pass, but 0 documents never verifies
    assert "manifest.json: 0 documents: the run accepted no rows (3 read, 3 rejected" in capsys.readouterr().out
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "empty.jsonl").write_bytes(b"")
    assert run_prep([tmp_path / "none"], tmp_path / "o2") == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "refinery prep: no rows read (empty input files?)"
    write_jsonl(tmp_path / "most" / "a.jsonl", [{"text": "good one"}] + [{"text": 3}] * 5)
    assert run_prep([tmp_path / "most"], tmp_path / "o3", "--max-reject-rate", "0.5") == 1
    assert "5 of 6 rows (83%) rejected, more than --max-reject-rate 0.5" in capsys.readouterr().err
    assert run_prep([tmp_path / "most"], tmp_path / "o3", "--max-reject-rate", "0.9") == 0
    capsys.readouterr()
    out = str(tmp_path / "o4")
    for argv in (["prep", "--input", str(tmp_path / "most"), "--output", out],
                 ["decon", "--eval", "e", "--train", "t", "--output", out],
                 ["prep-mixture", "--config", "mix.toml", "--data-root", out]):
        assert main([*argv, "--max-reject-rate", "5"]) == 2
        assert "--max-reject-rate must be between 0 and 1 (e.g. 0.05 for 5%), not 5" in _one_line(capsys)


def test_the_rejects_hint_follows_the_most_common_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from refinery.beam_pipelines.checks import rejection_hint

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.jsonl").write_text("hello world\nthis is plain text\n")
    assert run_prep([tmp_path / "plain"], tmp_path / "o") == 1
    warning = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("WARNING"))
    assert "Most are 'malformed JSON' (2 of the 2 reasons read): the files are not JSON rows (plain text?)" in warning
    assert "--text-field" not in warning
    assert "check --text-field" in str(rejection_hint(["missing text field 'text'"] * 2 + ["malformed JSON: x"]))
    assert rejection_hint(["row too large: 9 bytes"]) == ("The most common reason is 'row too large' (1 of the 1 "
                                                          "reasons read); check the input files.")
    assert rejection_hint([]) is None


def test_a_truncated_input_file_is_named_and_fails_the_run_unless_a_reject_rate_allows_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gzip

    data = gzip.compress("".join(json.dumps({"id": str(i), "text": f"hello number {i}"}) + "\n"
                                 for i in range(2000)).encode())
    (tmp_path / "in").mkdir()
    cut = tmp_path / "in" / "a.jsonl.gz"
    cut.write_bytes(data[:len(data) // 2])
    out = tmp_path / "o"
    assert run_prep([tmp_path / "in"], out) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"refinery prep: 1 input file(s) corrupt or cut short: {cut}: corrupt file after ")
    assert "EOFError" in last and last.endswith("give --max-reject-rate R to count each as one rejected row")
    assert not (out / "manifest.json").exists()  # a failed run: FAILED.json names the file instead
    [corrupt] = json.loads((out / "FAILED.json").read_text())["corrupt_files"]
    assert corrupt["path"] == str(cut) and corrupt["reason"].startswith("corrupt file after ")
    assert run_prep([tmp_path / "in"], out, "--max-reject-rate", "0.01") == 0  # 1 of ~976 rows
    assert f"WARNING refinery prep: {cut}: corrupt file after" in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["path"] for c in manifest["corrupt_files"]] == [str(cut)]
    read = manifest["rows"]["read"]
    assert manifest["rows"]["rejected"] == 1 and manifest["rows"]["accepted"] == read - 1  # counted apart, too
    assert run_prep([tmp_path / "in"], out, "--max-reject-rate", "0.0001") == 1
    assert "more than --max-reject-rate 0.0001" in capsys.readouterr().err


def test_changing_settings_on_an_output_says_what_is_replaced_and_another_commands_output_is_refused(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 6) == 0
    capsys.readouterr()
    r = subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", "--input", str(small_corpus),
                        "--output", str(out), "--num-shards", "2", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    err = r.stderr  # the console, the workers' lines included
    replaced = [ln for ln in err.splitlines() if "shard" in ln and "removing" in ln or "replaced the shards" in ln]
    # 3 files a shard: .npy, .idx, .docs.parquet
    assert len(replaced) == 1 and "removed 12 file(s) in 4 shard folder(s) not part of this one" in replaced[0], err
    assert sorted(p.name for p in out.glob("shard_*")) == ["shard_0000", "shard_0001"]  # no empty folder left
    assert main(["verify", str(out)]) == 0

    ev = write_jsonl(tmp_path / "ev" / "test.jsonl", [{"id": "q1", "text": "how many apples are left now"}])
    decon = tmp_path / "decon"
    assert main(["decon", "--eval", str(ev), "--train", str(small_corpus), "--output", str(decon),
                 "--no-progress"]) == 0
    capsys.readouterr()
    for argv in (["prep", "--input", str(small_corpus), "--output", str(decon)],
                 ["decon", "--eval", str(ev), "--train", str(small_corpus), "--output", str(out)]):
        assert main(argv) == 2
        line = _one_line(capsys)
        assert "holds the output of 'refinery " in line and "the two would mix" in line
    assert not (decon / "manifest.json").exists()


def test_a_dry_run_of_unlisted_remote_inputs_says_their_step_exists(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--input", "gs://my-bucket/crawl", "--output", str(tmp_path / "o"), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "not listed (a dry run reads nothing remote)" in said
    assert "no units planned here for: Tokenize units (its inputs are listed when the run starts" in said
    assert not (tmp_path / "o").exists()


def test_decon_shows_unreadable_training_rows_and_fails_when_none_is_used(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "ev" / "gsm" / "test.jsonl", [{"id": "q1", "text": "how many apples are left now"}])
    write_jsonl(tmp_path / "tr" / "t.jsonl", [{"text": 3}] * 3)
    argv = ["decon", "--eval", str(tmp_path / "ev"), "--train", str(tmp_path / "tr"), "--output", str(tmp_path / "d"),
            "--ngrams", "3", "--partitions", "1", "--runner", "direct", "--no-progress"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "  eval rows: read 1 = used 1 + unreadable or without text 0" in out
    assert "  training rows: read 3 = used 0 + unreadable or without text 3" in out
    assert err.strip().splitlines()[-1].startswith("refinery decon: no training rows accepted of 3 read (3 rejected")
    assert main([*argv, "--max-reject-rate", "1"]) == 0


def test_generate_fails_when_every_document_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          ckpt: str) -> None:
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "x", "text": 3}, {"id": "y", "text": None}])
    assert main(["generate", "--checkpoint", ckpt, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "g"),
                 "--text-field", "text", "--id-field", "id", "--max-tokens", "2", "--device", "cpu",
                 "--dtype", "float32", "--runner", "direct", "--no-progress"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "refinery generate: no documents accepted of 2 read (2 rejected; reasons in the error field of ")


def test_everyday_mistakes_are_one_line(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, ckpt: str) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["prep", "--input", str(small_corpus), "--output", str(tmp_path / "file")]) == 2
    assert "is a file" in _one_line(capsys)
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--input", str(small_corpus),
                 "--output", str(tmp_path / "g")]) == 2
    assert "--checkpoint" in _one_line(capsys)
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 2) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0 and main(["info", str(out)]) == 0
    assert main(["status", str(out / "manifest.json")]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "not found" in _one_line(capsys)

    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(["inspect", "--manifest", str(out / "manifest.json"), "--histogram", str(tmp_path / "h.png")]) == 2
    line = _one_line(capsys)
    assert line.endswith("matplotlib is not installed: pip install -e '.[plots]' (in the refinery checkout)")


def test_a_misspelt_runner_is_refused_before_anything_is_planned_or_written(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["prep", "--input", str(small_corpus)], ["decon", "--eval", str(small_corpus), "--train",
                                                              str(small_corpus)]):
        out = tmp_path / command[0]
        assert main([*command, "--output", str(out), "--runner", "flnk"]) == 2
        line = _one_line(capsys)
        assert "--runner flnk: not a runner; refinery's are local, direct, prism, portable, flink, dataflow" in line
        assert not out.exists()
    # Beam's own names still pass the check (they are Beam's to run)
    from refinery.runners import check_runner_name
    for name in ("PrismRunner", "prism", "FlinkRunner", "my.module.MyRunner", "DIRECT"):
        check_runner_name(name)


def test_missing_torch_names_the_extra_as_installed_from_a_clone(tmp_path: Path, small_corpus: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch, ckpt: str) -> None:
    """refinery is not on PyPI: the hint installs the checkout's extra."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    hint = "torch is not installed: pip install -e '.[inference]' (in the refinery checkout)"
    assert main(["tiny-checkpoint", str(tmp_path / "tiny")]) == 2
    assert _one_line(capsys) == f"refinery tiny-checkpoint: needs torch; {hint}"
    assert main(["generate", "--checkpoint", ckpt, "--input", str(small_corpus), "--output", str(tmp_path / "g")]) == 2
    assert _one_line(capsys) == f"refinery generate: the gpt-oss engine needs torch; {hint}"
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "g").exists()


def test_status_uses_the_one_completion_check(tmp_path: Path, small_corpus: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 3) == 0
    capsys.readouterr()
    npy = next(out.glob("shard_0001/*.npy"))
    npy.write_bytes(npy.read_bytes()[:100])
    assert main(["status", str(out)]) == 0
    rows = {line.split()[0]: line.split()[2:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["pack"] == ["3", "2", "0", "1"]  # units, done, failed, pending: the truncated shard is pending


def test_dry_run_on_every_pipeline_command_changes_nothing(tmp_path: Path, small_corpus: Path,
                                                           capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    docids = tmp_path / "docids.jsonl"
    docids.write_text('{"doc_id": "s//shard_0000/s-v1-shard-000000.npy#s=0:e=5"}\n')
    assert run_prep([small_corpus], tmp_path / "prepped", "--num-shards", 1, "--dataset", "s") == 0
    commands = {
        "prep": ["prep", "--input", str(small_corpus)],
        "decon": ["decon", "--eval", str(small_corpus), "--train", str(small_corpus)],
        "generate": ["generate", "--checkpoint", ckpt, "--input", str(small_corpus)],
        "oracle-label": ["hydra", "oracle-label", "--checkpoint", ckpt, "--input-docids", str(docids),
                         "--data-root", str(tmp_path / "prepped")],
    }
    for name, argv in commands.items():
        out = tmp_path / f"out-{name}"
        assert main([*argv, "--output", str(out), "--dry-run"]) == 0, name
        printed = capsys.readouterr().out
        assert "--dry-run: plan for" in printed and "pending" in printed, name
        assert not out.exists(), f"{name} --dry-run wrote {out}"


def test_progress_off_a_terminal_is_plain_lines(tmp_path: Path, small_corpus: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", "--input", str(small_corpus),
                           "--output", str(tmp_path / "o"), "--runner", "direct"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "tokenize: 1/1 units" in proc.stderr


def test_sigint_is_quiet_and_the_hint_comes_last(tmp_path: Path) -> None:
    """Ctrl-C to the whole process group of a 2-worker run: no traceback, exit 130, the hint last."""
    import signal
    import time

    corpus = tmp_path / "c"
    texts = gsm8k_texts(400)
    for k in range(12):
        write_jsonl(corpus / f"f{k:02d}.jsonl", [{"text": t * 20} for t in texts])
    log = tmp_path / "units.log"
    env = {**__import__("os").environ, "REFINERY_UNIT_LOG": str(log)}
    proc = subprocess.Popen([sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", "--input", str(corpus),
                             "--output", str(tmp_path / "o"), "--workers", "2", "--no-progress"],
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and '"start"' in log.read_text()):
        time.sleep(0.05)
    assert log.exists(), "no unit started"
    import os
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].strip().startswith("refinery prep --input")
    assert "Resume with:" in err.strip().splitlines()[-2]


def test_beams_memory_warning_is_not_shown(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """RunInference without scipy logs "Resource module is not available" on the root logger
    at every model load (seen with --runner direct); the CLI's logging drops that line."""
    from apache_beam.ml.inference import base

    from refinery.beam_pipelines.cli import configure_logging

    monkeypatch.setattr(base, "resource", None)  # what Beam sets when scipy is missing
    configure_logging(verbose=False)
    with caplog.at_level("INFO"):
        base._get_current_process_memory_in_bytes()
        logging.getLogger().warning("Waiting for grpc channel to be ready at localhost:1234.")  # the portable runner's
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger().warning("another warning")
    assert "Resource module" not in caplog.text and "another warning" in caplog.text
    assert "grpc channel" not in caplog.text and "fontManager" not in caplog.text


def test_tiny_checkpoint_command_writes_a_loadable_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from refinery.kernels.config import load_config
    from refinery.kernels.model import Transformer

    assert main(["tiny-checkpoint", str(tmp_path / "tiny"), "--layers", "2"]) == 0
    assert "wrote a tiny random gpt-oss" in capsys.readouterr().out
    config = load_config(tmp_path / "tiny")
    assert config.num_hidden_layers == 2 and config.vocab_size == 201088
    model = Transformer.from_checkpoint(str(tmp_path / "tiny"), device="cpu", dtype=torch.float32)
    assert model(torch.tensor([1, 2, 3])).shape == (3, 201088)


def test_a_derived_dataset_name_is_made_valid_and_never_blames_an_option_not_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--input w/données` without --dataset: the shards are named from `donnees`; the user gave
    no --dataset, so no error may name it."""
    write_jsonl(tmp_path / "w" / "données.jsonl", [{"id": "a", "text": "bonjour"}])
    (tmp_path / "w" / "sub").mkdir()
    write_jsonl(tmp_path / "w" / "sub" / "x.jsonl", [{"id": "b", "text": "salut"}])
    assert run_prep([tmp_path / "w" / "données.jsonl"], tmp_path / "out1", "--num-shards", 1) == 0
    assert json.loads((tmp_path / "out1" / "manifest.json").read_text())["dataset"] == "donnees"
    folder = tmp_path / "数据 (v2)"
    (tmp_path / "w").rename(folder)
    assert run_prep([folder], tmp_path / "out2", "--num-shards", 1) == 0
    assert json.loads((tmp_path / "out2" / "manifest.json").read_text())["dataset"] == "v2"
    assert "--dataset" not in capsys.readouterr().err


def test_an_output_of_other_inputs_is_not_replaced_without_force(tmp_path: Path, small_corpus: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`prep --input OTHER --output OUT` over OUT of another corpus replaced its shards with a
    warning (an hour of tokenization gone to one mistyped path). Now: exit 2, one line naming
    the old and new inputs, nothing touched; --force replaces; the same inputs with other
    settings still replace in one line, as before."""
    out = tmp_path / "out"
    other = tmp_path / "other"
    write_jsonl(other / "z.jsonl", [{"text": t} for t in gsm8k_texts(12, offset=200)])
    assert run_prep([small_corpus], out, "--num-shards", "2") == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run_prep([other], out, "--num-shards", "2") == 2
    line = _one_line(capsys)
    assert f"--output {out} holds the output of other inputs ({small_corpus}; now {other})" in line
    assert f"2 of its 2 file(s) are not inputs now ({small_corpus}/x.jsonl, {small_corpus}/y.jsonl)" in line
    assert f"1 input file(s) are new ({other}/z.jsonl)" in line
    assert "--force" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched
    assert run_prep([small_corpus / "x.jsonl"], out, "--num-shards", "2") == 2  # a part of it is other inputs too
    capsys.readouterr()
    assert run_prep([small_corpus / "*.jsonl"], out, "--num-shards", "2") == 0  # the same files, named otherwise
    assert run_prep([small_corpus], out, "--num-shards", "3") == 0  # same files, other settings: replaced
    assert run_prep([other], out, "--num-shards", "2", "--force") == 0
    assert json.loads((out / "manifest.json").read_text())["total_documents"] == 12


def test_an_id_field_no_row_has_is_refused_like_a_text_field(tmp_path: Path, small_corpus: Path,
                                                             capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    """A wrong --id-field was silent: every id fell back to relpath:row (prep, generate) or a
    hash (decon), and the shards differed. Given, it must be in some row of each file; rows
    without it are fine (small/y.jsonl has no id at all, x.jsonl has one)."""
    assert main(["prep", "--input", str(small_corpus / "x.jsonl"), "--output", str(tmp_path / "p"),
                 "--id-field", "doc_id"]) == 2
    line = _one_line(capsys)
    assert "--id-field 'doc_id': no row of" in line and "their fields: id, text" in line
    assert not (tmp_path / "p").exists()
    write_jsonl(tmp_path / "ev" / "e.jsonl", [{"id": "1", "text": "a question of some length here"}])
    assert main(["decon", "--eval", str(tmp_path / "ev"), "--train", str(small_corpus / "x.jsonl"),
                 "--output", str(tmp_path / "d"), "--id-field", "uid"]) == 2
    assert "--id-field 'uid': no row of" in _one_line(capsys)
    assert main(["generate", "--checkpoint", ckpt, "--input", str(small_corpus / "x.jsonl"), "--id-field", "uid",
                 "--output", str(tmp_path / "g")]) == 2
    assert "--id-field 'uid': no row of" in _one_line(capsys)
    # the field some rows have: accepted (run as a dry run: nothing written)
    assert main(["prep", "--input", str(small_corpus / "x.jsonl"), "--output", str(tmp_path / "p"),
                 "--id-field", "id", "--dry-run"]) == 0


def test_a_failed_run_never_says_done_nor_names_a_file_it_did_not_leave(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Plain text saved as .jsonl: the hint and exit 1, but the summary said `prep done ...
    manifest: OUT/manifest.json` with no manifest there. Now it says the run failed, and status
    and verify name the output as an unfinished run."""
    from refinery.beam_pipelines.command import failed_summary

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text("This is plain text.\nNot JSON at all.\n")
    out = tmp_path / "o"
    assert run_prep([tmp_path / "c"], out, "--num-shards", "2") == 1
    said = capsys.readouterr()
    assert "prep failed after" in said.out and " done " not in said.out
    assert "  manifest: none (the run failed" in said.out and not (out / "manifest.json").exists()
    assert "no rows accepted of 2 read" in said.err
    assert main(["verify", str(out / "manifest.json")]) == 1
    assert f"BAD  {out}: the refinery prep run failed ({out / 'FAILED.json'}): no rows accepted of 2 read" \
        in capsys.readouterr().out
    # the rule itself: only the first line's "done", only a path that is not there
    kept = str(tmp_path / "c" / "a.jsonl")
    assert failed_summary("decon", f"decon done in 1.0s; units run: x\n  rows: read 3 = used 0\n  report: {out}/r.html"
                          f" (and r.md)\n  input: {kept}").splitlines() == [
        "decon failed after 1.0s; units run: x", "  rows: read 3 = used 0",
        "  report: none (the run failed; `refinery status` shows what is unfinished)", f"  input: {kept}"]


def test_documents_without_an_id_are_counted_in_the_manifest(tmp_path: Path, small_corpus: Path) -> None:
    """Some rows without the id field are fine (named relpath:row), and said: the manifest
    counts them; a corpus whose rows all have one gets no such entry."""
    out = tmp_path / "o"
    assert run_prep([small_corpus], out, "--num-shards", "2") == 0  # x.jsonl: 40 rows with an id, y.jsonl: 30 without
    m = json.loads((out / "manifest.json").read_text())
    assert m["documents_without_id"] == {"id_field": "id", "documents": 30, "named": "relpath:row"}
    assert run_prep([small_corpus / "x.jsonl"], tmp_path / "ids", "--num-shards", "2") == 0
    assert "documents_without_id" not in json.loads((tmp_path / "ids" / "manifest.json").read_text())
