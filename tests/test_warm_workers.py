"""The local runner's warm workers: SDK workers forked from a process that imported Beam
ahead (runners.warm_workers), and what happens when the pool is not there."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from refinery.runners import pipeline_args, warm_workers
from refinery.runners.local import runnable


def test_workers_are_forked_from_the_warm_process_and_it_ends_with_the_pool() -> None:
    args = pipeline_args("local", 2)
    with warm_workers.pool(args) as pool:
        assert pool is not None and warm_workers.active() is pool
        with beam.Pipeline(options=PipelineOptions(runnable(args))) as p:
            # nested: pickled by value (the workers cannot import this test module)
            def forked(x: int) -> tuple[int, bool]:
                import os

                with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                    cmdline = f.read()
                return x, b"warm_workers\0serve" in cmdline

            out = p | beam.Create([1, 2, 3, 4]) | beam.Reshuffle() | beam.Map(forked)
            assert_that(out, equal_to([(i, True) for i in (1, 2, 3, 4)]))
    assert warm_workers.active() is None
    assert pool.proc.returncode == 0 and not os.path.exists(pool.dir)  # ended at the pool's close, cleaned up


def test_without_the_pool_a_worker_starts_as_usual() -> None:
    """A pool that is gone (its process killed, its socket removed): the attach command
    becomes an ordinary worker, and the job runs."""
    args = pipeline_args("local", 2)
    with warm_workers.pool(args) as pool:
        assert pool is not None
        pool.proc.kill()
        pool.proc.wait()
        if os.path.exists(pool.socket):  # bound, unless killed before it got that far
            os.remove(pool.socket)
        with beam.Pipeline(options=PipelineOptions(runnable(args))) as p:
            def main_module(x: int) -> tuple[int, str]:  # nested: pickled by value
                import sys

                spec = sys.modules["__main__"].__spec__
                assert spec is not None
                return x, spec.name

            out = p | beam.Create([1, 2]) | beam.Reshuffle() | beam.Map(main_module)
            assert_that(out, equal_to([(1, warm_workers.WORKER_MAIN), (2, warm_workers.WORKER_MAIN)]))


def test_no_pool_unless_local_multi_process(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not warm_workers.wanted(pipeline_args("local", 1))
    assert not warm_workers.wanted(pipeline_args("direct", 2))
    assert not warm_workers.wanted(["--runner=FlinkRunner", "--direct_running_mode=multi_processing"])
    assert warm_workers.wanted(pipeline_args("local", 2))
    monkeypatch.setenv("REFINERY_WARM_WORKERS", "0")
    assert not warm_workers.wanted(pipeline_args("local", 2))
    with warm_workers.pool(pipeline_args("local", 2)) as pool:
        assert pool is None


def test_the_warm_process_ends_when_the_driver_dies() -> None:
    """A driver killed without closing its pool: the warm process sees its stdin end and goes."""
    code = ("import os, sys\n"
            "from refinery.runners import warm_workers\n"
            "pool = warm_workers.Pool()\n"
            "print(pool.proc.pid, flush=True)\n"
            "os._exit(0)\n")
    driver = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    warm_pid = int(driver.stdout.split()[0])
    deadline = time.time() + 30
    while time.time() < deadline and _alive(warm_pid):
        time.sleep(0.05)
    assert not _alive(warm_pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
