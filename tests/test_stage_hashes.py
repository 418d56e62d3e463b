"""Every stage hash of today's commands, pinned (issue 62): a stage's hash names the folder of
its receipts (``OUTPUT/.refinery/<stage>/<stage_hash>/``), so a refactor that changes one
(a settings key renamed, a default moved, an identity built another way) makes every
existing output of that command run again from scratch.

Each command is run as the CLI runs it, for a fixed small argv, up to the point where it hands
its stages to ``run_and_report`` (nothing is run); the stages are bound as the planner binds
them (:func:`~refinery.transforms.resumable.bind_stages`, hashes chained) and each hash is
compared with the literal recorded when this test was written. The inputs lie under one fixed
folder (their absolute paths and mtimes enter the hashes), held under a lock while the module
runs, so two checkouts running this module at once take turns.

A changed hash here is a change of every output's receipts: make it on purpose, say so in
the commit, and record the new literal: ``REFINERY_RECORD_STAGE_HASHES=FILE pytest
tests/test_stage_hashes.py`` writes what each case computes to FILE (as JSON lines) instead of
comparing.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import gsm8k_rows, write_jsonl

from refinery.beam_pipelines import cli
from refinery.transforms.resumable import bind_stages

# {case: {stage: hash}}, as recorded on 2026-12-02 (main at 625f487)
PINS: dict[str, dict[str, str]] = {
    "prep": {"tokenize": "03c41c581f5c682b", "pack": "0fd7a46a1711674d", "manifest": "3f2039beb486b6a5"},
    "prep split": {
        "count": "8b8a56b198baea64", "tokenize": "8d56e39119df2266", "pack": "442d8a178e047bdf",
        "manifest": "6d899495e713cecb"
    },
    "prep exclude row": {"tokenize": "7b254c5e473b34e8", "pack": "0fae84b03fd0a798", "manifest": "9cb4ad141972dd1a"},
    "prep exclude span": {"tokenize": "8d41c10b36f665c9", "pack": "dfd54dd8385d4e36", "manifest": "188aa20a51f40c72"},
    "decon": {  # eval: the slices (issue 59), unchained: the hashes after it are those of before it
        "eval": "f4d901ba4ef43f1a", "index": "d99de09fdcfbfa7e", "scan": "db60e8b4d296d96e",
        "reduce": "35995e120bc7c264", "merge": "7a390f624375bb66"
    },
    "clean row": {"clean": "644b112156df699d", "manifest": "91e1bf5e7e68a455"},
    "clean span": {"clean": "7a3c5cc2505731bc", "manifest": "4d016eb6e8399f2c"},
    "dedup minhash": {
        "sign": "54750c225099ddf8", "bucket": "f91b60b445b28072", "verify": "cb3fa14e216a661c",
        "components": "bb8585d273ae135a", "report": "85b9e54a6da8a6f8"
    },
    "dedup exact": {
        "sign": "d73219ed8c8bf21c", "bucket": "b760a00bd6d53dbe", "components": "f78b7401dda28e3a",
        "report": "2c2c96b6cb225ece"
    },
    "generate": {"infer": "321e81d5df47c100", "merge": "cc84a7931ca7e748"},
    "hydra slices": {"slices": "3bfa2ff84fdfb25d"},
    "hydra oracle-label": {"infer": "37f5846889ffa1ff", "merge": "0fdb4521ede36020"},
}

ROOT = Path(f"/tmp/refinery-stage-hash-pins-{os.getuid()}")  # fixed: absolute input paths enter the hashes
MTIME_NS = 1_700_000_000 * 10**9  # every input's mtime (its "version" in the fingerprints)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    """The fixed folder, fresh, with the inputs every command reads; locked for the module."""
    with open(f"{ROOT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(ROOT, ignore_errors=True)
        _write_inputs(ROOT)
        try:
            yield ROOT
        finally:
            shutil.rmtree(ROOT, ignore_errors=True)


def _write_inputs(root: Path) -> None:
    train, test = gsm8k_rows("train")[:30], gsm8k_rows("test")[:10]
    docs = [{"id": f"doc-{i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(train)]
    for i in (3, 17):  # planted eval questions: decon lists these rows
        docs[i]["text"] += "\n" + test[i % 10]["question"] + " That was the question."
    write_jsonl(root / "corpus" / "a.jsonl", docs[:20])
    write_jsonl(root / "corpus" / "sub" / "b.jsonl", docs[20:])
    write_jsonl(root / "eval" / "test.jsonl", [{"id": f"test-{i}", "text": r["question"]} for i, r in enumerate(test)])
    ckpt = root / "ckpt"  # what generate's hash reads of a checkpoint: its files' relpaths, sizes, versions
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    _pin_mtimes(root)


def _pin_mtimes(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(dirpath, name), ns=(MTIME_NS, MTIME_NS))


def stage_hashes(monkeypatch: pytest.MonkeyPatch, *argv: object) -> dict[str, str]:
    """``refinery ARGV``'s stages, bound as the planner binds them: {stage name: stage hash}."""
    words = [str(a) for a in argv]
    parser, _ = cli.build_parser(words[0])
    args, unknown = parser.parse_known_args(words)
    assert not unknown, unknown
    mod = cli.command_module(args.command)
    handed: list[Any] = []

    def capture(pipeline: Any, flags: Any, beam_args: list[str]) -> int:
        handed.append(pipeline)
        return 0

    monkeypatch.setattr(mod, "run_and_report", capture)
    assert mod.run(args, []) == 0
    (pipeline,) = handed
    return {run.name: run.stage_hash for run in bind_stages(pipeline.stages, pipeline.output)}


@pytest.fixture(scope="module")
def decon_output(root: Path) -> Path:
    """A real decon run of the corpus (what prep --exclude-overlaps and clean read: its drop list)."""
    out = root / "decon"
    code = cli.main(["decon", "--eval", str(root / "eval" / "test.jsonl"), "--train", str(root / "corpus"),
                     "--output", str(out), "--ngrams", "8", "--runner", "direct", "--no-progress"])
    assert code == 0
    return out


def pinned(case: str, hashes: dict[str, str]) -> None:
    """``hashes`` are ``PINS[case]`` (or, recording, written down)."""
    if record := os.environ.get("REFINERY_RECORD_STAGE_HASHES"):
        with open(record, "a") as f:
            f.write(json.dumps({case: hashes}) + "\n")
        return
    assert hashes == PINS[case], case


def test_prep(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned("prep", stage_hashes(monkeypatch, "prep", "--input", root / "corpus", "--output", root / "out" / "prep",
                                "--num-shards", "2"))


def test_prep_split_inputs_and_a_budget(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs split by byte range (the count stage), a token budget, a template and an id field."""
    pinned("prep split", stage_hashes(monkeypatch, "prep", "--input", root / "corpus", "--output",
                                      root / "out" / "prep-split", "--num-shards", "3", "--unit-mb", "0.002",
                                      "--max-tokens", "5k", "--text-template", "{id}: {text}", "--id-field", "id",
                                      "--dataset", "pins"))


def test_prep_exclude_overlaps(root: Path, decon_output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ("prep", "--input", root / "corpus", "--output", root / "out" / "prep-excl",
            "--exclude-overlaps", decon_output)
    pinned("prep exclude row", stage_hashes(monkeypatch, *argv))
    pinned("prep exclude span", stage_hashes(monkeypatch, *argv, "--exclude-mode", "span"))


def test_decon(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned("decon", stage_hashes(monkeypatch, "decon", "--eval", root / "eval" / "test.jsonl", "--train",
                                 root / "corpus", "--output", root / "out" / "decon", "--ngrams", "8", "13",
                                 "--slice-mb", "0.05"))


def test_clean(root: Path, decon_output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ("clean", "--train", root / "corpus", "--exclude-overlaps", decon_output, "--output", root / "out" / "clean")
    pinned("clean row", stage_hashes(monkeypatch, *argv))
    pinned("clean span", stage_hashes(monkeypatch, *argv, "--exclude-mode", "span"))


def test_dedup(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ("dedup", "--input", root / "corpus", "--output", root / "out" / "dedup")
    pinned("dedup minhash", stage_hashes(monkeypatch, *argv))
    pinned("dedup exact", stage_hashes(monkeypatch, *argv, "--mode", "exact"))


def test_generate(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned("generate", stage_hashes(monkeypatch, "generate", "--checkpoint", root / "ckpt", "--input",
                                    root / "corpus", "--output", root / "out" / "generate", "--max-tokens", "6",
                                    "--docs-per-unit", "8"))


def test_hydra(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slices (of a real prep output's shards) and oracle-label (of a doc-id file)."""
    shards = root / "shards"
    assert cli.main(["prep", "--input", str(root / "corpus"), "--output", str(shards), "--num-shards", "2",
                     "--runner", "direct", "--no-progress"]) == 0
    write_jsonl(root / "docids" / "docids_val.jsonl", [{"doc_id": "doc-1", "source": "pins"}])
    _pin_mtimes(shards)
    _pin_mtimes(root / "docids")
    pinned("hydra slices", stage_hashes(monkeypatch, "hydra", "slices", "--data-root", shards, "--output",
                                        root / "out" / "slices"))
    pinned("hydra oracle-label", stage_hashes(monkeypatch, "hydra", "oracle-label", "--input-docids",
                                              root / "docids" / "docids_val.jsonl", "--data-root", shards,
                                              "--checkpoint", root / "ckpt", "--output", root / "out" / "oracle",
                                              "--max-tokens", "64"))
