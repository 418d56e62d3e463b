"""refinery on Prism, Beam's portable runner in Go (``--runner prism``), built into the cache.

- Without the binary (no Prism needed): the Go module version of a Beam release, the cache
  reused when its recorded version matches and refused in one line when it does not, a
  build without Go in one line, ``--runner prism``'s flags, and the CLI's one line (exit 2)
  before anything is planned or written.
- On one Prism process shared by the module (the cached binary on a free port, jobs sent
  with ``--job_endpoint``): prep (``--exclude-overlaps`` and a tokenizer.json), decon, dedup
  (both modes, and prep ``--exclude-duplicates`` of its list),
  generate and ``hydra oracle-label`` on the tiny checkpoint, and prep-mixture write the same bytes
  as the same commands on the local runner.
- A command's own Prism (``--runner prism`` alone): the refinery process killed with
  SIGKILL mid-job takes its Prism with it, and the same command run again writes the same
  bytes without running again a unit that had finished.

The binary comes from ``make test`` (``make prism-cache``: ``python -m refinery.runners.prism_local
build`` into ``.cache/prism``). Without it these tests skip with one reason, unless
``REFINERY_REQUIRE_PRISM=1`` (set by ``.ci/run``), which turns that into a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Iterator, NoReturn

import pytest
from helpers import gsm8k_rows, gsm8k_texts, run_prep, write_jsonl
from reliability_helpers import child_env, final_digest, read_unit_log, recomputed_units, refinery_cmd, spawn

from refinery.beam_pipelines.cli import main
from refinery.runners import RunnerOptionsError, pipeline_args, prepare_run, tool_cache
from refinery.runners import prism_local as prism

REQUIRED = os.environ.get("REFINERY_REQUIRE_PRISM") == "1"


def _unavailable(reason: str) -> NoReturn:
    if REQUIRED:
        pytest.fail(f"{reason} (REFINERY_REQUIRE_PRISM=1: CI must run the Prism tests)")
    pytest.skip(reason)


# ---------------------------------------------------------------------------------------
# The cache and the flags (no Prism)
# ---------------------------------------------------------------------------------------

def _fake_cache(root: Path, version: str | None) -> Path:
    """A cache whose "binary" says one thing and exits 3, recorded as built for ``version``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / prism.BINARY).write_bytes(b"#!/bin/sh\necho 'starting'\necho 'cannot serve: port in use' >&2\nexit 3\n")
    (root / prism.BINARY).chmod(0o755)
    if version is not None:
        (root / prism.VERSION_FILE).write_text(version + "\n")
        (root / prism.PATCH_FILE).write_text(prism.PATCH_ID + "\n")  # as built here (listening privately)
    return root


def test_module_version_of_a_beam_release() -> None:
    assert prism.module_version("2.77.0") == "v2.77.0"
    assert prism.module_version("2.78.0rc2") == "v2.78.0-RC2"
    with pytest.raises(prism.BuildError, match="not a release"):
        prism.module_version("2.79.0.dev0")


def test_the_cache_is_reused_only_at_the_installed_beam_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    beam = tool_cache.installed_beam_version()
    good = _fake_cache(tmp_path / "good", beam)
    assert prism.find_prism(good) == good / "prism"
    # reused: go is never run (this one does not exist)
    assert prism.build(good, go=str(tmp_path / "no-go"), log=lambda s: None) == good / "prism"

    old = _fake_cache(tmp_path / "old", "2.60.0")
    assert prism.find_prism(old) is None
    assert re.fullmatch(rf"the Prism in {old} was built for Beam 2.60.0, not the installed {re.escape(beam)}: "
                        r"build it with 'make prism-cache' .*", prism.missing_reason(old))
    assert prism.find_prism(_fake_cache(tmp_path / "unrecorded", None)) is None  # no version: not trusted
    unpatched = _fake_cache(tmp_path / "unpatched", beam)
    (unpatched / prism.PATCH_FILE).unlink()  # Prism as Beam publishes it: it would listen on every interface
    assert prism.find_prism(unpatched) is None
    assert f"the Prism in {unpatched} was built without refinery's patch" in prism.missing_reason(unpatched)
    assert prism.missing_reason(tmp_path / "empty").startswith(f"no Prism binary in {tmp_path / 'empty'}: ")

    monkeypatch.setattr(shutil, "which", lambda name: None)  # the module prism_local looks for go with
    with pytest.raises(prism.BuildError, match=r"^go is not on PATH: "):
        prism.build(old, log=lambda s: None)
    assert (old / prism.VERSION_FILE).read_text().strip() == "2.60.0"  # left as it was


def test_prism_flags_and_what_a_run_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pipeline_args("prism", 4) == ["--runner=PrismRunner", "--environment_type=LOOPBACK"]
    assert pipeline_args("prism", None, ["--environment_type=EXTERNAL"]) == ["--environment_type=EXTERNAL",
                                                                             "--runner=PrismRunner"]
    cache = _fake_cache(tmp_path / "cache", tool_cache.installed_beam_version())
    monkeypatch.setenv(prism.CACHE_ENV, str(cache))
    args = pipeline_args("prism", None)
    assert prepare_run("prism", args) == args + [f"--prism_location={cache / 'prism'}"]
    # Beam's own name gets the cached binary too, never Beam's download
    assert prepare_run("PrismRunner", ["--runner=PrismRunner"])[-1] == f"--prism_location={cache / 'prism'}"
    running = [*args, "--job_endpoint=localhost:8073"]
    assert prepare_run("prism", running) == running  # a Prism already running: no binary needed
    with pytest.raises(RunnerOptionsError, match=r"--prism_location /nowhere/prism: no such file"):
        prepare_run("prism", [*args, "--prism_location=/nowhere/prism"])
    monkeypatch.setenv(prism.CACHE_ENV, str(tmp_path / "empty"))
    with pytest.raises(RunnerOptionsError, match=r"^--runner prism: no Prism binary in .*'make prism-cache'"):
        prepare_run("prism", args)


def test_cli_without_a_usable_prism_is_one_line_and_writes_nothing(
        small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prism.CACHE_ENV, str(_fake_cache(tmp_path / "old", "2.60.0")))
    out = tmp_path / "out"
    assert main(["prep", "--input", str(small_corpus), "--output", str(out), "--runner", "prism"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"refinery prep: --runner prism: the Prism in .* was built for Beam 2.60.0, not the "
                        r"installed .*make prism-cache.*", err), err
    assert not out.exists()

    # the version matches, but the binary does not start: one line, with what it said
    monkeypatch.setenv(prism.CACHE_ENV, str(_fake_cache(tmp_path / "broken", tool_cache.installed_beam_version())))
    assert main(["prep", "--input", str(small_corpus), "--output", str(out), "--runner", "prism"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"refinery prep: --runner prism: Prism \(.*/broken/prism\) exited 3 at start: cannot serve: "
                        r"port in use", err_lines[-1]), err_lines
    assert "Traceback" not in "".join(err_lines) and not (out / ".refinery").exists()  # nothing was planned


# ---------------------------------------------------------------------------------------
# One Prism for the module: every command, the same bytes as the local runner
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prism_binary() -> Path:
    found = prism.find_prism()
    if found is None:
        _unavailable(f"Prism tests skipped: {prism.missing_reason()}")
    return found


@pytest.fixture(scope="module")
def on_prism(prism_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The runner flags of a job on one Prism process, started for this module and stopped
    (by its pid) at its end."""
    log = tmp_path_factory.mktemp("prism") / "prism.log"
    with prism.PrismServer(prism_binary, log=log) as server:
        assert server.proc is not None  # started
        yield ["--runner", "prism", f"--job_endpoint={server.endpoint}", "--no-progress"]
        assert server.proc.poll() is None, log.read_text()[-2000:]  # it served the whole module
    assert server.proc.poll() is not None


def both(out: Path, on_prism: list[str], *argv: object) -> tuple[dict[str, str], dict[str, str]]:
    """``refinery ARGV`` on Prism into ``out/prism`` and on the local runner (in-process) into ``out/local``:
    the digests of what each wrote."""
    args = [str(a) for a in argv]
    assert main([*args, "--output", str(out / "prism"), *on_prism]) == 0
    assert main([*args, "--output", str(out / "local"), "--runner", "direct", "--no-progress"]) == 0
    return final_digest(out / "prism"), final_digest(out / "local")


def test_prep_and_decon_equal_local(on_prism: list[str], tmp_path: Path) -> None:
    from test_prep_tokenizers import _train

    train, test = gsm8k_rows("train")[:300], gsm8k_rows("test")[:40]
    docs = [{"id": f"doc-{i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(train)]
    for k, i in enumerate((5, 50, 120, 299)):  # an eval question inside four training documents
        docs[i]["text"] += " " + test[k]["question"]
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", docs[:200])
    write_jsonl(corpus / "b.jsonl", docs[200:])
    evals = write_jsonl(tmp_path / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"t{i}", "text": r["question"]} for i, r in enumerate(test)])

    got, want = both(tmp_path / "decon", on_prism, "decon", "--eval", evals, "--train", corpus, "--ngrams", "8", "13",
                     "--slice-mb", "0.05")
    assert got == want and "stats/contaminated_train_docs.jsonl" in got
    listed = (tmp_path / "decon" / "local" / "stats" / "contaminated_train_docs.jsonl").read_text().splitlines()
    assert len(listed) >= 4

    tok = tmp_path / "tok"
    tok.mkdir()
    _train(gsm8k_texts(300), 500, ["<|endoftext|>"]).save(str(tok / "tokenizer.json"))
    got, want = both(tmp_path / "prep", on_prism, "prep", "--input", corpus, "--num-shards", "3", "--unit-mb", "0.02",
                     "--tokenizer", tok / "tokenizer.json", "--exclude-overlaps", tmp_path / "decon" / "local")
    assert got == want
    manifest = json.loads((tmp_path / "prep" / "prism" / "manifest.json").read_text())
    assert manifest["rows"]["excluded"] == len(listed) and len(manifest["shards"]) == 3
    # span mode: the overlapping passages cut out, the same pieces on both runners
    got, want = both(tmp_path / "span", on_prism, "prep", "--input", corpus, "--num-shards", "3", "--unit-mb", "0.02",
                     "--exclude-overlaps", tmp_path / "decon" / "local", "--exclude-mode", "span",
                     "--exclude-window", "10", "--exclude-min-chars", "20")
    assert got == want
    cut = json.loads((tmp_path / "span" / "prism" / "manifest.json").read_text())["excluded_overlaps"]
    assert cut["mode"] == "span" and cut["rows_split"] == len(listed) and cut["pieces"] >= len(listed)


def test_dedup_and_its_exclusion_equal_local(on_prism: list[str], tmp_path: Path) -> None:
    texts = gsm8k_texts(150)
    docs = [{"id": f"d{i}", "text": t if i % 10 else texts[i // 10]} for i, t in enumerate(texts)]
    corpus = write_jsonl(tmp_path / "corpus" / "a.jsonl", docs[:80]).parent
    write_jsonl(corpus / "b.jsonl", docs[80:])
    for mode in ("minhash", "exact"):
        got, want = both(tmp_path / mode, on_prism, "dedup", "--input", corpus, "--mode", mode, "--partitions", "3",
                         "--slice-mb", "0.02")
        assert got == want and len((tmp_path / mode / "prism" / "dup_list.jsonl").read_text().splitlines()) == 13
    got, want = both(tmp_path / "prep", on_prism, "prep", "--input", corpus, "--num-shards", "2",
                     "--exclude-duplicates", tmp_path / "minhash" / "local")
    assert got == want
    assert json.loads((tmp_path / "prep" / "prism" / "manifest.json").read_text())["rows"]["excluded"] == 13


def test_generate_hydra_and_mixture_equal_local(on_prism: list[str], tmp_path: Path) -> None:
    from engine_fixtures import write_harmony_checkpoint
    from test_mixture import _two_source_config

    ckpt = write_harmony_checkpoint(tmp_path / "ckpt", num_hidden_layers=1)
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"g{i}", "text": t} for i, t in enumerate(gsm8k_texts(5))])
    got, want = both(tmp_path / "gen", on_prism, "generate", "--checkpoint", ckpt, "--input", docs, "--max-tokens", "4",
                     "--dtype", "float32", "--device", "cpu", "--max-seq-len", "256", "--max-batch", "4",
                     "--docs-per-unit", "2", "--temperature", "0.8", "--seed", "7")
    assert got == want and len((tmp_path / "gen" / "prism" / "generations.jsonl").read_text().splitlines()) == 5

    corpus = write_jsonl(tmp_path / "corpus" / "x.jsonl",
                         [{"id": f"x{i}", "text": t} for i, t in enumerate(gsm8k_texts(12))]).parent
    assert run_prep(corpus, tmp_path / "data", "--num-shards", "2") == 0
    assert main(["hydra", "slices", "--data-root", str(tmp_path / "data"), "--output", str(tmp_path / "slices")]) == 0
    got, want = both(tmp_path / "oracle", on_prism, "hydra", "oracle-label", "--checkpoint", ckpt, "--input-docids",
                     tmp_path / "slices" / "docids_val.jsonl", "--data-root", tmp_path / "data",
                     "--constrained-json", "--max-tokens", "38", "--dtype", "float32", "--device", "cpu")
    assert got == want and "labels.jsonl" in got

    cfg = _two_source_config(tmp_path / "mix")
    mix = ["prep-mixture", "--config", cfg, "--flow", "tiny", "--num-shards", "2", "--valid-percent", "10"]
    assert main([*map(str, mix), "--data-root", str(tmp_path / "mix" / "prism"), *on_prism]) == 0
    assert main([*map(str, mix), "--data-root", str(tmp_path / "mix" / "local"), "--runner", "direct",
                 "--no-progress"]) == 0
    got, want = final_digest(tmp_path / "mix" / "prism"), final_digest(tmp_path / "mix" / "local")
    assert got == want and sum(name.endswith("manifest.json") for name in got) == 3


# ---------------------------------------------------------------------------------------
# A command's own Prism, and the refinery process killed mid-job
# ---------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_driver_killed_mid_job_takes_its_prism_and_a_rerun_finishes(prism_binary: Path, tmp_path: Path) -> None:
    texts = gsm8k_texts(1500)
    corpus = tmp_path / "corpus"
    for k in range(6):
        write_jsonl(corpus / f"part-{k}.jsonl", [{"id": f"{k}-{i}", "text": t} for i, t in enumerate(texts)])
    argv = ["prep", "--input", corpus, "--num-shards", "2", "--unit-mb", "0", "--no-progress"]
    assert run_prep(corpus, tmp_path / "ref", "--num-shards", "2", "--unit-mb", "0") == 0

    out, unit_log = tmp_path / "out", tmp_path / "units.log"
    env = child_env(unit_log, **{prism.CACHE_ENV: prism_binary.parent})
    proc = spawn(refinery_cmd(*argv, "--output", out, "--runner", "prism"), env)
    deadline = time.time() + 120
    while sum(e["event"] == "end-completed" for e in read_unit_log(unit_log)) < 2:
        assert proc.poll() is None, f"the run ended first:\n{proc.stderr()[-2000:]}"
        assert time.time() < deadline, "no 2 units completed within 120 s"
        time.sleep(0.02)
    own = [p for p in _children(proc.pid) if Path(f"/proc/{p}/exe").resolve() == prism_binary.resolve()]
    assert len(own) == 1, own  # the command's one Prism
    os.kill(proc.pid, signal.SIGKILL)  # the refinery process alone, not its group
    done = {(e["stage"], e["unit"]) for e in read_unit_log(unit_log) if e["event"] == "end-completed"}
    at_kill = len(read_unit_log(unit_log))
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _gone(own[0]), "its Prism outlived the killed refinery process"

    r = spawn(refinery_cmd(*argv, "--output", out, "--runner", "prism"), env)
    assert r.wait(timeout=300) == 0, r.stderr()[-3000:]
    assert final_digest(out) == final_digest(tmp_path / "ref")
    events = read_unit_log(unit_log)
    assert len(done) >= 2 and recomputed_units(events) == []
    assert not [e for e in events[at_kill:] if e["event"] == "start" and (e["stage"], e["unit"]) in done]
