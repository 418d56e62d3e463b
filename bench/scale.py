"""Benchmark: does a command's job, and its driver's planning, grow with the corpus?

For F one-line ``.jsonl`` input files (F = 10,000 and 100,000 by default; ``--million``
adds 1,000,000), each measured in a fresh process:

1. ``proto``: the bytes of the portable runner-API proto of ``refinery prep``'s whole job
   (every stage over its whole plan: what a job server such as Flink's receives), and of
   ``refinery decon``'s with the same files as its training side;
2. ``dataflow``: the bytes of the Dataflow job (``--dry_run``: the JSON request the runner
   would send, with its steps; Dataflow refuses one over 10 MB without
   ``--experiments=upload_graph``);
3. ``plan``: the driver's planning of prep over the F files: listing and fingerprinting them,
   making the units and writing the plan into the output (seconds, and the process's peak
   RSS).

The inputs are made once under ``--dir`` (default: a folder of the temp dir, kept for the
next run; 1,000,000 files take about 4 GB of disk and a minute to write). Run it with
nothing else on the machine:

    .venv/bin/python bench/scale.py                 # F = 10,000 and 100,000
    .venv/bin/python bench/scale.py --million       # and 1,000,000
    .venv/bin/python bench/scale.py --files 2000    # a quick look
    .venv/bin/python bench/scale.py --replan 10000 100000   # a finished run's no-op re-plan
    .venv/bin/python bench/scale.py --replan 10000 --resume # a run with one deleted file to redo

``--replan``: a finished prep (and decon) over F one-line files on an object store (fsspec
``slowstore://``: files in a temp folder, each call counted as a request), then the same
command again, nothing left to do, with 20 ms per request: its seconds and the requests the
driver made (goal: <= 30 s and <= 500 requests for a finished 100,000-unit run; decon over
100,000 files has 100,000 scan units). With ``--resume`` one user-facing file is deleted
before the second run (a shard; decon's overlap metrics), so that it has work to do: the
requests counted are the driver's, outside the job (whose workers check the receipts).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable

MEASURE = r'''
import json, sys, time
which, folder, out = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
from refinery.transforms.io import storage
result = {}
if which == "plan":
    from refinery.transforms.resumable import bind_stages, record_inputs, write_plans
    from refinery.transforms.prep.stages import PrepConfig, build_stages
    t0 = time.perf_counter()
    inputs = storage.expand_inputs([folder])
    t1 = time.perf_counter()
    cfg = PrepConfig(inputs=inputs, output=out, dataset="scale", num_shards=64)
    runs = bind_stages(build_stages(cfg), out)
    t2 = time.perf_counter()
    for r in runs:
        record_inputs(r, list(r.stage.config().inputs))
    write_plans(runs, [])
    t3 = time.perf_counter()
    result = {"files": len(inputs), "list_s": t1 - t0, "units_s": t2 - t1, "write_s": t3 - t2, "plan_s": t3 - t0,
              "units": sum(len(r.stage.plan()) for r in runs)}
else:
    from refinery.runners.translate import command_pipeline, dataflow_job, runner_api
    args = ["--runner=DirectRunner"]
    if which == "prep":
        from refinery.transforms.prep.stages import PrepConfig, build_stages
        stages = build_stages(PrepConfig(inputs=storage.expand_inputs([folder]), output=out, dataset="scale",
                                         num_shards=64))
    else:
        from refinery.transforms.decon.stages import DeconSettings, build_stages
        evals = out + "-eval.jsonl"
        with open(evals, "w") as f:
            f.write(json.dumps({"id": "e0", "text": "an eval question about nothing at all today"}) + "\n")
        stages = build_stages(DeconSettings(eval_paths=[evals], train_paths=[folder], ns=[13]))
    result["proto_bytes"] = len(runner_api(command_pipeline(stages, out, args)).SerializeToString())
    from refinery.runners.translate import job_bytes
    df = ["--runner=DataflowRunner", "--project=my-project", "--region=us-central1",
          "--temp_location=gs://my-bucket/tmp"]
    job = dataflow_job(stages, out, df)
    result["dataflow_bytes"] = job_bytes(job)
hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
result["peak_rss_mb"] = hwm / 1024
print("RESULT", json.dumps(result))
'''


REPLAN = r'''
import json, math, sys, threading, time
import os, tempfile
import fsspec
from fsspec.implementations.local import LocalFileSystem

class SlowStore(LocalFileSystem):
    """An object store (files under a local folder: slowstore://a/b is the local /a/b) that counts
    requests and spends ``latency`` seconds on each: every outermost call of the API below is
    one request, a listing one per 1,000 entries."""
    protocol = "slowstore"
    latency = 0.0
    requests = 0
    _depth = threading.local()

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True, **kwargs)  # an object store has no folders to make

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len("slowstore://"):] if path.startswith("slowstore://") else path
        return LocalFileSystem._strip_protocol("/" + path.lstrip("/"))

def _wrap(name):
    real = getattr(LocalFileSystem, name)
    def call(self, *args, **kwargs):
        depth = getattr(SlowStore._depth, "n", 0)
        SlowStore._depth.n = depth + 1
        try:
            out = real(self, *args, **kwargs)
        finally:
            SlowStore._depth.n = depth
        if depth == 0:
            n = max(1, math.ceil(len(out) / 1000)) if name in ("find", "glob", "ls") and hasattr(out, "__len__") else 1
            SlowStore.requests += n
            time.sleep(SlowStore.latency * n)
        return out
    setattr(SlowStore, name, call)

for name in ("info", "ls", "find", "glob", "exists", "isdir", "isfile", "open", "cat_file", "cat", "rm", "rm_file",
             "pipe_file", "mv", "copy", "makedirs", "mkdir", "size"):
    _wrap(name)
fsspec.register_implementation("slowstore", SlowStore, clobber=True)

which, n = sys.argv[1], int(sys.argv[2])
root = tempfile.mkdtemp(prefix="refinery-slowstore-")
for i in range(n):
    os.makedirs(f"{root}/in/{i // 1000:04d}", exist_ok=True)
    with open(f"{root}/in/{i // 1000:04d}/f{i:07d}.jsonl", "w") as f:
        f.write(json.dumps({"id": f"d{i}", "text": f"document {i} about nothing"}) + "\n")
os.makedirs(f"{root}/eval")
with open(f"{root}/eval/test.jsonl", "w") as f:
    f.write(json.dumps({"id": "e0", "text": "document 7 about nothing"}) + "\n")
evals = f"slowstore:/{root}/eval"  # a folder: decon before 2026-11-26 misnamed a remote file given by itself
from refinery.beam_pipelines.cli import main
if which == "prep":
    argv = ["prep", "--input", f"slowstore:/{root}/in", "--output", f"slowstore:/{root}/out", "--num-shards", "64"]
else:
    argv = ["decon", "--eval", evals, "--train", f"slowstore:/{root}/in", "--output", f"slowstore:/{root}/out",
            "--ngrams", "3"]
argv += ["--runner", "direct", "--no-progress"]
t0 = time.perf_counter()
assert main(argv) == 0
first = time.perf_counter() - t0
if sys.argv[4] == "resume":  # one user-facing file deleted: the run has work to do
    os.remove(f"{root}/out/" + ("shard_0000/" + os.listdir(f"{root}/out/shard_0000")[0] if which == "prep"
                                else "stats/overlap_metrics.jsonl"))
    import refinery.runners.jobs as jobs
    run_job = jobs.run_job

    def job_uncounted(*args, **kwargs):  # the job's own requests are its workers', not the driver's
        SlowStore.latency, latency = 0.0, SlowStore.latency
        requests = SlowStore.requests
        try:
            return run_job(*args, **kwargs)
        finally:
            SlowStore.requests, SlowStore.latency = requests, latency
    jobs.run_job = job_uncounted
SlowStore.requests, SlowStore.latency = 0, float(sys.argv[3])
t0 = time.perf_counter()
assert main(argv) == 0
print("RESULT", json.dumps({"first_s": first, "replan_s": time.perf_counter() - t0, "requests": SlowStore.requests}))
import shutil
shutil.rmtree(root)
'''


def replan(which: str, n: int, latency: float = 0.02, mode: str = "noop") -> dict[str, Any]:
    """A finished run of ``which`` over ``n`` one-line files on an object store, then the same
    command again with ``latency`` seconds per request: its seconds and the requests the
    driver made. ``mode``: ``noop`` (nothing to do), or ``resume`` (one user-facing file
    deleted first: a shard, or decon's overlap metrics; the job's own requests, its
    workers', are not counted, and cost no latency)."""
    p = subprocess.run([PYTHON, "-c", REPLAN, which, str(n), str(latency), mode], capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"re-plan of {which} over {n} files failed:\n{p.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT "):])
    return result


def make_inputs(folder: Path, n: int) -> Path:
    """``n`` one-line ``.jsonl`` files under ``folder/n`` (1,000 per subfolder), made once."""
    root = folder / str(n)
    done = root / ".complete"
    if done.exists():
        return root
    t0 = time.perf_counter()
    for i in range(n):
        sub = root / f"{i // 1000:04d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:07d}.jsonl").write_text(json.dumps({"id": f"d{i}", "text": f"document {i} about nothing"}) + "\n")
    done.write_text("")
    print(f"  made {n:,} input files in {time.perf_counter() - t0:.0f}s under {root}", flush=True)
    return root


def measure(which: str, folder: Path, out: str) -> dict[str, Any]:
    p = subprocess.run([PYTHON, "-c", MEASURE, which, str(folder), out], capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{which} on {folder} failed:\n{p.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT "):])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, nargs="+", default=[10_000, 100_000], help="input file counts")
    ap.add_argument("--million", action="store_true", help="add 1,000,000 files")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "refinery-bench-scale"),
                    help="where the inputs are made (kept for the next run)")
    ap.add_argument("--replan", type=int, nargs="*", metavar="F",
                    help="only measure a finished run's no-op re-plan over F files on an object store with 20 ms per "
                         "request (default F: 10,000 and 100,000)")
    ap.add_argument("--resume", action="store_true",
                    help="with --replan: delete one user-facing file first, so that the rerun has work to do, and "
                         "count the driver's requests outside the job")
    args = ap.parse_args()
    if args.replan is not None:
        mode = "resume" if args.resume else "noop"
        what = "one deleted file redone:" if args.resume else "a finished run re-plans in"
        for n in args.replan or [10_000, 100_000]:
            for which in ("prep", "decon"):
                r = replan(which, n, mode=mode)
                print(f"F={n:>9,}  {which}: {what} {r['replan_s']:.1f}s with {r['requests']:,} driver "
                      f"requests at 20 ms each (the first run took {r['first_s']:.0f}s without latency)", flush=True)
        return
    counts = args.files + ([1_000_000] if args.million else [])
    rows = []
    for n in counts:
        folder = make_inputs(Path(args.dir), n)
        with tempfile.TemporaryDirectory() as tmp:
            prep = measure("prep", folder, os.path.join(tmp, "prep"))
            decon = measure("decon", folder, os.path.join(tmp, "decon"))
            plan = measure("plan", folder, os.path.join(tmp, "plan"))
        rows.append((n, prep, decon, plan))
        print(f"F={n:>9,}  prep proto {prep['proto_bytes']:>11,} B  dataflow {prep['dataflow_bytes']:>11,} B | "
              f"decon proto {decon['proto_bytes']:>11,} B  dataflow {decon['dataflow_bytes']:>11,} B | "
              f"plan {plan['plan_s']:6.1f}s (list {plan['list_s']:.1f}s, units {plan['units_s']:.1f}s, "
              f"write {plan['write_s']:.1f}s) {plan['units']:,} units, peak RSS {plan['peak_rss_mb']:,.0f} MB",
              flush=True)
    if len(rows) > 1:
        (n0, p0, d0, _), (n1, p1, d1, _) = rows[0], rows[1]
        print(f"growth {n0:,} -> {n1:,} files: prep proto x{p1['proto_bytes'] / p0['proto_bytes']:.2f}, "
              f"decon proto x{d1['proto_bytes'] / d0['proto_bytes']:.2f} (goal <= 1.5)")


if __name__ == "__main__":
    main()
