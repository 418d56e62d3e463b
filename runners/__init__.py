"""PipelineOptions builders: turn ``--runner NAME`` plus our few options into Beam arguments.

``local`` (default): DirectRunner, multi-processing, one worker per core (``--workers``);
with one worker it runs in-process. ``direct``: DirectRunner in-process. ``portable``:
PortableRunner, by default with the embedded job service and a LOOPBACK environment (the
job API that Flink's job server speaks). ``flink`` / ``dataflow``: FlinkRunner /
DataflowRunner; Dataflow workers install this package from its ``setup.py``. Any other name
is passed to Beam as ``--runner=NAME``. Flags the user gave win over every default here.
"""
from __future__ import annotations

import os
from pathlib import Path

RUNNERS = ("local", "direct", "portable", "flink", "dataflow")


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _defaults(args: list[str], defaults: dict[str, str]) -> list[str]:
    return args + [f"{k}={v}" for k, v in defaults.items() if not _has(args, k)]


def setup_file() -> str | None:
    """This project's setup.py (for ``--setup_file``), when running from a source checkout."""
    path = Path(__file__).resolve().parent.parent / "setup.py"
    return str(path) if path.exists() else None


def pipeline_args(runner: str = "local", workers: int | None = None, beam_args: list[str] | None = None) -> list[str]:
    """Beam command-line arguments for ``runner``; ``beam_args`` are passed through unchanged."""
    args = list(beam_args or [])
    name = runner.lower()
    if name == "local":
        n = workers or os.cpu_count() or 1
        if n == 1:
            return _defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                    "--direct_num_workers": "1"})
        return _defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "multi_processing",
                                "--direct_num_workers": str(n)})
    if name == "direct":
        return _defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                "--direct_num_workers": str(workers or 1)})
    if name == "portable":
        return _defaults(args, {"--runner": "PortableRunner", "--job_endpoint": "embed",
                                "--environment_type": "LOOPBACK"})
    if name == "flink":
        defaults = {"--runner": "FlinkRunner"}
        if workers:
            defaults["--parallelism"] = str(workers)
        return _defaults(args, defaults)
    if name == "dataflow":
        defaults = {"--runner": "DataflowRunner"}
        if setup_file():
            defaults["--setup_file"] = setup_file()
        if workers:
            defaults["--max_num_workers"] = str(workers)
        return _defaults(args, defaults)
    return _defaults(args, {"--runner": runner})
