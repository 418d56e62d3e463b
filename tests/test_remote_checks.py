"""Where a run reads and writes is checked before anything runs, and a dry run reads nothing remote.

Every test here runs with each network connection and name lookup outside this machine
refused and recorded (there must be none): a missing or malformed Dataflow option, a bad
bucket name, a local path under Dataflow and ``gs://`` without credentials are each one line
and exit 2, at once; a Dataflow dry run with ``gs://`` inputs and output lists nothing, says
what it did not list, and still describes each job; the commands of the README and of
docs/RUNNERS.md pass as dry runs.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import gcs

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUNNERS = ROOT / "docs" / "RUNNERS.md"  # the Dataflow and Flink commands, moved from the README
DATAFLOW = ["--runner", "dataflow", "--project", "my-project", "--region", "us-central1",
            "--temp_location", "gs://my-bucket/tmp"]
GS_PREP = ["prep", "--input", "gs://my-bucket/crawl/*.jsonl", "--output", "gs://my-bucket/tokens"]


@pytest.fixture(autouse=True)
def _offline(no_network: None) -> None:
    """Every test here runs with the network refused (conftest's ``no_network``)."""
    return no_network


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Google credentials anywhere: no key file, no gcloud login, not on a Google Cloud VM."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(gcs, "_on_google_cloud", lambda: False)


def _err_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    return err


def _one_line_each(capsys: pytest.CaptureFixture[str], expected: list[str], command: str = "prep") -> None:
    lines = _err_lines(capsys)
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(f"refinery {command}: {start}"), (line, start)


@pytest.mark.parametrize("drop, add, expected", [
    ("--project", [], ["--runner dataflow needs --project PROJECT_ID"]),
    ("--region", [], ["--runner dataflow needs --region REGION"]),
    ("--temp_location", [], ["--runner dataflow needs --temp_location gs://BUCKET/PATH"]),
    ("--project", ["--project", "P"], ["--project P: not a project ID"]),
    ("--temp_location", ["--temp_location", "gs://b/tmp"], ["--temp_location gs://b/tmp: invalid bucket name 'b'"]),
    ("--temp_location", ["--temp_location", "/tmp/x"], ["--temp_location /tmp/x: give gs://BUCKET/PATH"]),
    (None, ["--job_name", "Nightly_Prep"], ["--job_name Nightly_Prep: lowercase letters"]),
    (None, ["--region", "US-central1"], ["--region US-central1: not a Compute Engine region"]),
])
def test_each_bad_dataflow_option_is_one_line(
        drop: str, add: list[str], expected: list[str], capsys: pytest.CaptureFixture[str],
        no_credentials: None) -> None:
    args = list(DATAFLOW)
    if drop:
        del args[args.index(drop):args.index(drop) + 2]
    for dry in ([], ["--dry-run"]):
        assert main([*GS_PREP, *args, *add, *dry]) == 2
        _one_line_each(capsys, expected)


def test_every_problem_at_once_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Local paths under Dataflow (its workers cannot see them) and each missing option."""
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": "x"}])
    assert main(["prep", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                 "--runner", "dataflow", "--temp_location", "gs://my-bucket/tmp", "--dry-run"]) == 2
    _one_line_each(capsys, ["--runner dataflow needs --project", "--runner dataflow needs --region",
                            f"--input {tmp_path / 'in'}: a local path, which Dataflow's workers cannot see",
                            f"--output {tmp_path / 'out'}: a local path"])
    assert not (tmp_path / "out").exists()


def test_bucket_names_are_checked_for_every_runner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--input", "gs://Crawl_Data/x.jsonl", "--output", str(tmp_path / "o"), "--dry-run"]) == 2
    _one_line_each(capsys, ["--input gs://Crawl_Data/x.jsonl: invalid bucket name 'Crawl_Data'"])
    assert main(["decon", "--eval", "gs://ab/e.jsonl", "--train", "gs://my-bucket/t", "--output", "gs://x/o",
                 "--dry-run"]) == 2
    _one_line_each(capsys, ["--eval gs://ab/e.jsonl: invalid bucket name 'ab'", "--output gs://x/o: invalid bucket"],
                   "decon")


@pytest.mark.parametrize("name, ok", [
    ("my-bucket", True), ("a.b.c", True), ("logs_2024", True), ("x" * 63, True), ("x" * 64, False),
    ("ab", False), ("My-Bucket", False), ("-bucket", False), ("bucket-", False), ("a..b", False),
    ("192.168.1.1", False), ("goog-data", False), ("my-google-data", False), ("", False),
])
def test_bucket_name_rules(name: str, ok: bool) -> None:
    assert (gcs.bucket_problem(f"gs://{name}/x") is None) == ok


def test_gs_without_credentials_is_one_line_naming_the_login(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        no_credentials: None) -> None:
    assert main(["prep", "--input", "gs://my-bucket/crawl/", "--output", str(tmp_path / "o")]) == 2
    _one_line_each(capsys, ["no Google Cloud credentials for gs://"])
    assert main(["verify", "gs://my-bucket/tokens/manifest.json"]) == 2
    [line] = _err_lines(capsys)
    assert "gcloud auth application-default login" in line and line.startswith("refinery verify: ")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "gone.json"))
    assert main([*GS_PREP, *DATAFLOW]) == 2
    [line] = _err_lines(capsys)
    assert f"GOOGLE_APPLICATION_CREDENTIALS names {tmp_path / 'gone.json'}, which is not a file" in line
    assert "gcloud auth application-default login" in line
    assert not (tmp_path / "o").exists()


def test_dataflow_dry_run_reads_nothing_remote(capfd: pytest.CaptureFixture[str], no_credentials: None) -> None:
    """gs:// inputs are not listed, receipts on gs:// not read; each job is still described
    (the one job, from the plan it can make), and the missing credentials are a note, not an error."""
    assert main([*GS_PREP, *DATAFLOW, "--workers", "3", "--machine_type", "n2-standard-8", "--dry-run"]) == 0
    out, err = capfd.readouterr()
    assert "not listed (a dry run reads nothing remote), so not counted below: gs://my-bucket/crawl/*.jsonl" in out
    assert "receipts under gs://my-bucket/tokens not read" in out
    assert re.search(r"pack +\w{16} +8 +\? +\? +\?", out)
    assert out.count("dataflow job for refinery prep") == 1  # one job; tokenize plans no unit unlisted
    assert "steps: Pack shards, Write manifest" in out
    assert "machine n2-standard-8, max workers 3" in out and "workflow.tar.gz" in out
    assert "gcloud auth application-default login" in err and "Traceback" not in err
    assert "No module named build" not in err  # Beam's stager builds the sdist with `build` (installed with refinery)
    assert "Building sdist" not in out + err  # build's progress: captured (transforms/io/beam_private.py)


def _readme_commands(runner: str) -> list[str]:
    """The ``refinery ...`` commands of the README and docs/RUNNERS.md that name ``--runner RUNNER``
    (continuations joined)."""
    text = (README.read_text() + "\n" + RUNNERS.read_text()).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines()
            if line.strip().startswith("refinery ") and f"--runner {runner}" in line]


def test_the_docs_dataflow_and_flink_commands_pass_as_dry_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        no_credentials: None) -> None:
    pytest.importorskip("torch", reason="generate's dry run picks its device with torch")
    from engine_fixtures import write_harmony_checkpoint

    ckpt = write_harmony_checkpoint(tmp_path / "ckpt", num_hidden_layers=1)
    commands = _readme_commands("dataflow") + _readme_commands("flink")
    assert len(commands) >= 7, commands  # prep (twice), decon, generate on Dataflow; prep on Flink (cluster, local)
    for command in commands:
        argv = [a.replace("/models/gpt-oss-20b", str(ckpt)) for a in shlex.split(command, comments=True)[1:]]
        assert main([*argv, "--dry-run"]) == 0, (command, capsys.readouterr().err)
        output = argv[argv.index("--output") + 1]
        assert f"--dry-run: plan for {output} " in capsys.readouterr().out, command


def test_a_dry_run_describes_prep_excluding_a_remote_decon_output(
        capfd: pytest.CaptureFixture[str], no_credentials: None) -> None:
    """--exclude-overlaps gs://...: the drop list is not read in a dry run; the job is described."""
    assert main([*GS_PREP, *DATAFLOW, "--exclude-overlaps", "gs://my-bucket/decon", "--dry-run"]) == 0
    out, err = capfd.readouterr()
    assert "excluding the training rows that gs://my-bucket/decon found overlapping: its drop list is not read " \
           "(a dry run reads nothing remote)" in out
    assert out.count("dataflow job for refinery prep") == 1 and "Traceback" not in err


@pytest.mark.parametrize("tokenizer", ["gs://my-bucket/llama3/", "some-org/some-model@v1"])
def test_a_dry_run_does_not_read_a_remote_tokenizer(
        capfd: pytest.CaptureFixture[str], no_credentials: None, tokenizer: str) -> None:
    assert main([*GS_PREP, *DATAFLOW, "--tokenizer", tokenizer, "--dry-run"]) == 0
    out, err = capfd.readouterr()
    assert f"--tokenizer {tokenizer}: not read (a dry run reads nothing remote)" in out
    assert out.count("dataflow job for refinery prep") == 1 and "Traceback" not in err
