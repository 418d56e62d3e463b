"""A pipeline command's flags that are not its own must be Beam's PipelineOptions: found by
asking Beam's option classes, with the nearest flag named for a typo.

Asking Beam means importing it (about 1.5 s), so a flag error would wait for it: for the Beam
version recorded in :mod:`~refinery.beam_pipelines.beam_flag_names` the flags are read from
there instead, and Beam is imported only once the arguments are valid. Any other installed Beam
version is asked directly. ``python -m refinery.beam_pipelines.beam_flags --write`` records the
installed version's flags (``tests/test_cli_strict.py`` fails when the record and Beam differ)."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import sys
from importlib import metadata
from pathlib import Path

from refinery.beam_pipelines import beam_flag_names
from refinery.beam_pipelines.checks import UsageError
from refinery.transforms.io import beam_private

# ---------------------------------------------------------------------------------------
# Flags: what is not ours must be Beam's
# ---------------------------------------------------------------------------------------

OUR_RUNNER_FLAGS = ("--gpu",)  # consumed by refinery.runners (dataflow), not Beam


@functools.lru_cache(maxsize=1)
def beam_flags() -> frozenset[str]:
    """Every flag Beam's PipelineOptions define (``--job_name``, ``--temp_location``, ...),
    runner-specific ones (Flink, Spark, portable) included: the recorded list when the
    installed Beam is the recorded version (no import of Beam), else :func:`live_beam_flags`."""
    if installed_beam_version() == beam_flag_names.BEAM_VERSION:
        return frozenset(beam_flag_names.FLAGS)
    return live_beam_flags()


def installed_beam_version() -> str | None:
    """The installed apache-beam's version (its package metadata: no import), None without one."""
    try:
        return metadata.version("apache-beam")
    except metadata.PackageNotFoundError:
        return None


def live_beam_flags() -> frozenset[str]:
    """:func:`beam_flags` asked of Beam itself (imports it, with its runner modules)."""
    for module in ("apache_beam.runners.portability.flink_runner",
                   "apache_beam.runners.portability.spark_runner",
                   "apache_beam.runners.portability.portable_runner"):
        with contextlib.suppress(ImportError):
            __import__(module)
    return beam_private.beam_option_flags()


def check_beam_args(command: str, parser: argparse.ArgumentParser, leftover: list[str]) -> list[str]:
    """``leftover`` (the flags the command's parser did not take) if every flag in it is one of
    Beam's options (or ours, see :data:`OUR_RUNNER_FLAGS`); else :class:`UsageError` naming
    the first unknown one with the nearest known flag ("did you mean --num-shards?")."""
    if not leftover:
        return leftover
    known = beam_flags() | set(OUR_RUNNER_FLAGS)
    after_flag = False
    for token in leftover:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            if name not in known:
                ours = sorted(s for s in beam_private.option_flags(parser) if s.startswith("--"))
                close = difflib.get_close_matches(name, ours, n=1, cutoff=0.6) or \
                    difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]}?" if close else " (not a refinery or Beam option)"
                raise UsageError(f"refinery {command}: unknown option {name}{hint}")
            after_flag = "=" not in token
        elif not after_flag:
            raise UsageError(f"refinery {command}: unexpected argument {token!r}")
        else:
            after_flag = False
    return leftover




def write_flag_names(path: Path) -> None:
    """Record the installed Beam's flags in ``path`` (the module :mod:`beam_flag_names`)."""
    head = (beam_flag_names.__doc__ or "").strip()
    body = "".join(f'    "{flag}",\n' for flag in sorted(live_beam_flags()))
    path.write_text(f'"""{head}"""\n\nBEAM_VERSION = "{installed_beam_version()}"\n\nFLAGS = (\n{body})\n')


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m refinery.beam_pipelines.beam_flags --write  (records the installed Beam's flags)")
    write_flag_names(Path(__file__).with_name("beam_flag_names.py"))
