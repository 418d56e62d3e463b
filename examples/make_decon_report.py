"""Writes ``examples/decon_report.html``: the report page of ``refinery decon`` on the bundled data
(the GSM8K test questions of ``tests/data/gsm8k`` against ``examples/sample_corpus``, n = 5 9 13).

``make report-example`` runs it; ``tests/test_decon_report.py`` runs it into a temporary folder
and checks that the checked-in page is what it writes. The inputs are copied into a temporary
folder with one fixed modification time and named by the same relative paths, so that the
page (which shows each input's size and modification time) is the same bytes on every checkout.

    python examples/make_decon_report.py [OUTPUT_HTML]   (default: examples/decon_report.html)
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from refinery.beam_pipelines import decon

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUTS = ("tests/data/gsm8k/test.jsonl.gz", "examples/sample_corpus")
MTIME = 1735689600  # 2025-01-01 00:00:00 UTC, every input's modification time on the page
ARGS = ["--eval", "tests/data/gsm8k/test.jsonl.gz", "--eval-text-field", "question",
        "--train", "examples/sample_corpus", "--ngrams", "5", "9", "13", "--output", "out", "--no-progress"]
DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def copy_inputs(root: str) -> None:
    """The inputs under ``root`` at their relative paths, each file modified at :data:`MTIME`."""
    for rel in INPUTS:
        src, dst = os.path.join(REPO, rel), os.path.join(root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
    for folder, _, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(folder, name), (MTIME, MTIME))


def main(argv: list[str]) -> int:
    target = os.path.abspath(argv[0] if argv else os.path.join(REPO, "examples", "decon_report.html"))
    with tempfile.TemporaryDirectory() as root:
        copy_inputs(root)
        here = os.getcwd()
        os.chdir(root)  # the inputs are named by relative paths, as on the page
        try:
            args, extra = decon.build_parser().parse_known_args(ARGS)
            if extra or decon.run(args, DIRECT) != 0:
                print(f"refinery decon failed (arguments not understood: {extra})" if extra else
                      "refinery decon failed", file=sys.stderr)
                return 1
        finally:
            os.chdir(here)
        shutil.copyfile(os.path.join(root, "out", "stats", "report.html"), target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
