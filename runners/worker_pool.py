"""Beam's SDK worker pool as a process, on loopback and for this user only.

What ``python -m apache_beam.runners.worker.worker_pool_main --service_port=PORT`` runs (the
EXTERNAL environment of a Flink task manager: each ``StartWorker`` request starts an SDK
worker process that runs the pipeline's code), except that it listens on ``127.0.0.1``, not
on every interface, and refuses the calls of any other user (:mod:`.same_user`): the task
manager that asks for workers runs as the same user. The local Flink cluster of
:mod:`.flink_local` runs this one::

    python -m refinery.runners.worker_pool --service_port=PORT [--container_executable=PATH]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer

from refinery.transforms.io.beam_private import worker_pool_on

from .same_user import LOOPBACK_HOST, SameUserOnly


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refinery.runners.worker_pool", description=__doc__.split("\n\n")[0])
    p.add_argument("--service_port", type=int, required=True, help="the port to listen on (on 127.0.0.1)")
    p.add_argument("--container_executable", default=None, help="a worker's boot command (Beam's flag)")
    args, _ = p.parse_known_args(argv)
    pool = BeamFnExternalWorkerPoolServicer(use_process=True, container_executable=args.container_executable)
    address, server = worker_pool_on(LOOPBACK_HOST, args.service_port, [SameUserOnly()], pool)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger(__name__).info("worker pool at %s, for uid %s only", address, SameUserOnly().uid)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
