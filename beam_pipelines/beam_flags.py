"""A pipeline command's flags that are not its own must be Beam's PipelineOptions: found by
asking Beam's option classes, with the nearest flag named for a typo."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import functools

from refinery.beam_pipelines.checks import UsageError
from refinery.transforms.core import beam_private

# ---------------------------------------------------------------------------------------
# Flags: what is not ours must be Beam's
# ---------------------------------------------------------------------------------------

OUR_RUNNER_FLAGS = ("--gpu",)  # consumed by refinery.runners (dataflow), not Beam


@functools.lru_cache(maxsize=1)
def beam_flags() -> frozenset[str]:
    """Every flag Beam's PipelineOptions define (``--job_name``, ``--temp_location``, ...),
    runner-specific ones (Flink, Spark, portable) included."""
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


