"""The command layer: each command reads argparse's ``args`` once, into a frozen settings
object, and its checks and job take those settings; ``refinery --help`` imports no command's
module, and a command imports its own module only."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_jsonl

from refinery.beam_pipelines import command, decon, prep
from refinery.beam_pipelines.checks import UsageError

COMMAND_MODULES = ("prep", "decon", "generate", "hydra", "prep_mixture", "verify", "info", "status",
                   "inspect_shards", "regenerate_index", "tiny_checkpoint", "launch")


def _imported_after(code: str) -> set[str]:
    """The command modules (and Beam) imported by ``code``, run in a fresh interpreter."""
    probe = (f"import sys\n{code}\n"
             "print('imported:', *(m for m in sys.modules if m == 'apache_beam' or "
             f"m.rpartition('.')[2] in {COMMAND_MODULES!r} and m.startswith('refinery.beam_pipelines.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(done.stdout.rpartition("imported:")[2].split())  # after what --help printed


def test_help_imports_no_command_module_nor_beam() -> None:
    """Before, the parser imported all eleven command modules to build ``refinery --help``."""
    code = ("from refinery.beam_pipelines import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass")
    assert _imported_after(code) == set()


def test_a_command_builds_its_own_parser_only() -> None:
    code = "from refinery.beam_pipelines import cli\ncli.build_parser('status')"
    assert _imported_after(code) == {"refinery.beam_pipelines.status"}


def _prep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prep.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_prep_settings_are_read_once_and_frozen(tmp_path: Path) -> None:
    args = _prep_args("--input", "a.jsonl", "b/", "--output", str(tmp_path / "out"), "--num-shards", "3", "--force",
                      "--tokenizer", "cl100k_base")
    s = prep.settings_from_args(args)
    assert s.inputs == ("a.jsonl", "b/") and s.num_shards == 3 and s.run.force and not s.run.dry_run
    assert s.tokenizer.tokenizer == "cl100k_base" and s.given == ["a.jsonl", "b/"]
    name = "num_shards"
    with pytest.raises(dataclasses.FrozenInstanceError):  # settings cannot change after the parse
        setattr(s, name, 4)


def test_prep_checks_take_settings_without_argparse(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "x.jsonl", [{"text": "one two three"}, {"text": "four"}])
    out = str(tmp_path / "out")
    cfg, found = prep.checked_config(prep.PrepSettings(output=out, inputs=(str(corpus),), num_shards=2))
    assert cfg.dataset == "corpus" and cfg.num_shards == 2 and [Path(f.path).name for f in found.files] == ["x.jsonl"]
    with pytest.raises(UsageError, match=r"^refinery prep: --num-shards must be at least 1$"):
        prep.checked_config(prep.PrepSettings(output=out, inputs=(str(corpus),), num_shards=0))
    with pytest.raises(UsageError, match=r"^refinery prep: --text-field 'body': no row of .*x\.jsonl has it"):
        prep.checked_config(prep.PrepSettings(output=out, inputs=(str(corpus),), text_field="body"))


def test_decon_checks_take_settings_without_argparse(tmp_path: Path) -> None:
    flags = decon.DeconFlags(output=str(tmp_path / "out"), train_paths=("t.jsonl",))
    with pytest.raises(UsageError, match=r"^refinery decon: give the eval data: --eval PATH"):
        decon.checked_job(flags)
    both = dataclasses.replace(flags, eval_paths=("e.jsonl",), eval_text_field="q", eval_text_template="{q}")
    with pytest.raises(UsageError, match=r"^refinery decon: give --eval-text-field or --eval-text-template, not both$"):
        decon.checked_job(both)
    settings = decon.stage_settings(dataclasses.replace(flags, eval_paths=("e.jsonl",), ngrams=(5, 9)))
    assert settings.ns == [5, 9] and settings.eval_paths == ["e.jsonl"] and settings.train_text_field == "text"


def test_run_flags_of_a_command_without_them_are_the_defaults() -> None:
    assert command.RunFlags.from_args(argparse.Namespace()) == command.RunFlags()
    assert command.RunFlags.from_args(argparse.Namespace(dry_run=True, workers=3)).workers == 3
