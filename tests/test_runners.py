"""Runner options, and every Beam stage of every pipeline built for every runner without running it.

- ``pipeline_args`` per target (local, direct, prism, portable, flink, dataflow incl. ``--gpu``).
- Each Beam job of each pipeline in :data:`PIPELINES` (prep, prep-mixture, decon, generate,
  hydra oracle-label, hydra grade), under each runner's options, builds and translates to
  the runner-API proto with its runner's environment; the DoFn that writes the units'
  receipts (``RunUnits`` of a stage job, ``Write`` of an inference wave) unpickles to the
  same stage (hash, output, units), and an inference wave holds its task's model handler.
- The same jobs on DataflowRunner with ``--dry_run``: the job description Dataflow
  would receive (worker pool, image, packages, service options), with every network
  connection attempt refused and recorded (there must be none).

Adding a pipeline = one entry in :data:`PIPELINES`: a function that writes tiny inputs
under a folder and returns its resumable runs (:class:`Jobs`: stages, output, the stage of
each Beam job, how stages become jobs).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.testing.util import assert_that, equal_to
from helpers import gsm8k_texts, write_jsonl

from refinery.runners import RUNNERS, RunnerOptionsError, pipeline_args, setup_file
from refinery.runners.dataflow import GPU_MACHINES, parse_gpu
from refinery.runners.translate import command_pipeline, dataflow_job, runner_api, step_names
from refinery.transforms.inference.tasks import Task
from refinery.transforms.resumable import Stage, StageRun

GCP = ["--project=refinery-test", "--region=us-central1", "--temp_location=gs://refinery-test-bucket/tmp"]
CPU_IMAGE = "registry.example/refinery-cpu:1"
GPU_IMAGE = "registry.example/refinery-gpu:1"


# ---------------------------------------------------------------------------------------
# pipeline_args
# ---------------------------------------------------------------------------------------

def test_local_and_direct_args() -> None:
    assert pipeline_args("local", 3) == ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                         "--direct_num_workers=3", "--beam_plugins=refinery.runners.worker_exit"]
    assert pipeline_args("local", 1) == ["--runner=DirectRunner", "--direct_running_mode=in_memory",
                                         "--direct_num_workers=1"]
    assert pipeline_args("direct", 2) == ["--runner=DirectRunner", "--direct_running_mode=in_memory",
                                          "--direct_num_workers=2"]
    # the user's flags win, in either spelling
    assert pipeline_args("local", 3, ["--direct_num_workers", "5"]) == [
        "--direct_num_workers", "5", "--runner=DirectRunner", "--direct_running_mode=multi_processing",
        "--beam_plugins=refinery.runners.worker_exit"]
    assert set(RUNNERS) == {"local", "direct", "prism", "portable", "flink", "dataflow"}
    assert pipeline_args("SparkRunner", 4, ["--x=1"]) == ["--x=1", "--runner=SparkRunner"]


def test_local_jobs_run_on_the_fn_api_runner_not_prism() -> None:
    """The DirectRunner's flags run on LocalRunner (Beam's FnApiRunner, no detour through
    Prism); other runners' flags are untouched; a light job runs in the driver's process."""
    from refinery.runners.local import LOCAL_RUNNER, in_process, runnable

    local = pipeline_args("local", 2)
    assert runnable(local) == [a for a in local if not a.startswith("--runner")] + [f"--runner={LOCAL_RUNNER}"]
    assert runnable(["--runner=FlinkRunner", "--x=1"]) == ["--runner=FlinkRunner", "--x=1"]
    assert "--direct_running_mode=in_memory" in in_process(local) and "--direct_num_workers=1" in in_process(local)
    assert in_process(["--runner=FlinkRunner"]) == ["--runner=FlinkRunner"]

    # the options reach the worker processes (the DirectRunner passes them the same way),
    # and with them the plugin that ends a worker quickly
    # nested: pickled by value, the workers cannot import this test module
    def seen_in_worker(_: int) -> tuple[str | None, bool, bool]:
        import json
        import os
        import sys

        from refinery.runners.worker_exit import in_worker

        options = json.loads(os.environ["PIPELINE_OPTIONS"])  # {"beam:option:NAME:v1": value}
        return options.get("beam:option:job_name:v1"), in_worker(), "refinery.runners.worker_exit" in sys.modules

    options = PipelineOptions(runnable(pipeline_args("local", 2, ["--job_name=from-the-driver"])))
    with beam.Pipeline(options=options) as p:
        seen = p | beam.Create([1, 2]) | beam.Reshuffle() | beam.Map(seen_in_worker)
        assert_that(seen, equal_to([("from-the-driver", True, True)] * 2))


@pytest.mark.parametrize("status,rc", [("3", 3), ("None", 7)])
def test_quick_exit_ends_with_the_status_and_flushes(tmp_path: Path, status: str, rc: int) -> None:
    """exit_quickly: the process ends with status() (or as Python would, when None), after
    the other atexit handlers and with its output flushed."""
    import subprocess
    import sys

    code = ("import atexit, sys\n"
            "from refinery.runners.quick_exit import exit_quickly\n"
            f"exit_quickly(lambda: {status})\n"
            "atexit.register(lambda: print('later handler ran', end=''))\n"
            "print('unflushed', end='')\n"
            "sys.exit(7)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == rc and done.stdout == "unflushedlater handler ran"
    # the console script imports it first: Beam imported then would start threads that do
    # not block SIGINT/SIGTERM, and a stop signal landing in one of them would be lost
    light = ("import sys, refinery.beam_pipelines.cli, refinery.runners.quick_exit; "
             "assert 'apache_beam' not in sys.modules")
    subprocess.run([sys.executable, "-c", light], check=True, timeout=60)


def test_the_worker_plugin_does_nothing_outside_beams_worker() -> None:
    """Imported by any other process, the plugin leaves its exit alone (status 5 stays 5)."""
    import subprocess
    import sys

    code = "import sys\nimport refinery.runners.worker_exit as w\nassert not w.in_worker()\nsys.exit(5)\n"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 5


def test_portable_args() -> None:
    assert pipeline_args("portable") == ["--runner=PortableRunner", "--job_endpoint=embed",
                                         "--environment_type=LOOPBACK"]
    remote = pipeline_args("portable", None, ["--job_endpoint=jobserver:8099", "--environment_type=DOCKER",
                                              f"--sdk_container_image={CPU_IMAGE}"])
    assert f"--environment_config={CPU_IMAGE}" in remote  # Beam reads the DOCKER image from here
    assert "--job_endpoint=embed" not in remote and "--environment_type=LOOPBACK" not in remote


def test_flink_args() -> None:
    from refinery.runners.flink import JVM_OPENS

    opens = [f"--job_server_jvm_properties={p}" for p in JVM_OPENS]  # the job server's JVM on Java 17
    assert opens[0] == "--job_server_jvm_properties=--add-opens=java.base/java.lang=ALL-UNNAMED"
    assert pipeline_args("flink", 4) == ["--runner=FlinkRunner", "--parallelism=4", *opens]  # [auto]: local, LOOPBACK
    mine = pipeline_args("flink", None, ["--job_server_jvm_properties=-Xmx2g"])
    assert mine == ["--job_server_jvm_properties=-Xmx2g", "--runner=FlinkRunner"]  # the user's JVM flags win
    cluster = pipeline_args("flink", 8, ["--flink_master=jm:8081", f"--sdk_container_image={CPU_IMAGE}"])
    assert cluster[-6:-3] == ["--runner=FlinkRunner", "--parallelism=8", "--environment_type=DOCKER"]
    assert f"--environment_config={CPU_IMAGE}" in cluster
    assert not any(a.startswith("--setup_file") for a in cluster)  # the image has the package
    stock = pipeline_args("flink", None, ["--flink_master=jm:8081"])
    assert f"--setup_file={setup_file()}" in stock and "--parallelism" not in " ".join(stock)
    external = pipeline_args("flink", 2, ["--flink_master=jm:8081", "--environment_type=EXTERNAL",
                                          "--environment_config=localhost:50000"])
    assert external == ["--flink_master=jm:8081", "--environment_type=EXTERNAL", "--environment_config=localhost:50000",
                        "--runner=FlinkRunner", "--parallelism=2", *opens]


def test_flink_job_service_only_where_a_job_server_runs_here() -> None:
    from refinery.runners import job_service

    # another runner, a job server of the user's, or the uber jar sent to a cluster: args as they are
    for args in (["--runner=DirectRunner"], ["--runner=FlinkRunner", "--job_endpoint=js:8099"],
                 ["--runner=FlinkRunner", "--flink_master=jm:8081", "--flink_submit_uber_jar"]):
        with job_service(args) as got:
            assert got == args
    # (a FlinkRunner that needs one gets --job_endpoint of a job server shared by all its jobs:
    # tests/test_flink.py counts one job server per command)


def test_dataflow_args_cpu_and_gpu() -> None:
    cpu = pipeline_args("dataflow", 10, GCP)
    assert cpu == GCP + ["--runner=DataflowRunner", f"--setup_file={setup_file()}", "--max_num_workers=10"]
    gpu = pipeline_args("dataflow", 2, [*GCP, "--gpu", "nvidia-l4", f"--sdk_container_image={GPU_IMAGE}"])
    assert "--gpu" not in gpu and "nvidia-l4" not in gpu  # ours, consumed
    assert "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver" in gpu
    assert "--experiments=no_use_multiple_sdk_containers" in gpu and "--machine_type=g2-standard-8" in gpu
    mine = pipeline_args("dataflow", None, [*GCP, "--gpu=nvidia-h100-80gb:2", "--machine_type=a3-custom",
                                            "--experiments=no_use_multiple_sdk_containers",
                                            f"--sdk_container_image={GPU_IMAGE}"])
    assert "--machine_type=a3-custom" in mine and not any(a.startswith("--machine_type=a3-highgpu") for a in mine)
    assert mine.count("--experiments=no_use_multiple_sdk_containers") == 1
    assert "--dataflow_service_options=worker_accelerator=type:nvidia-h100-80gb;count:2;install-nvidia-driver" in mine
    assert parse_gpu("NVIDIA-L4:4") == ("nvidia-l4", 4) and GPU_MACHINES["nvidia-l4"][4] == "g2-standard-48"
    with pytest.raises(RunnerOptionsError, match="sdk_container_image"):
        pipeline_args("dataflow", None, [*GCP, "--gpu", "nvidia-l4"])
    with pytest.raises(RunnerOptionsError, match="TYPE:COUNT"):
        pipeline_args("dataflow", None, [*GCP, "--gpu=nvidia-l4:x", f"--sdk_container_image={GPU_IMAGE}"])
    with pytest.raises(RunnerOptionsError, match="give --machine_type"):
        pipeline_args("dataflow", None, [*GCP, "--gpu=nvidia-tesla-t4:3", f"--sdk_container_image={GPU_IMAGE}"])
    with pytest.raises(RunnerOptionsError, match="needs a value"):
        pipeline_args("dataflow", None, [*GCP, "--gpu"])


def test_cli_refuses_bad_runner_flags_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from refinery.beam_pipelines.cli import main

    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": "x"}])
    out = tmp_path / "out"
    assert main(["prep", "--input", str(tmp_path / "in"), "--output", str(out), "--runner", "dataflow",
                 *GCP, "--gpu", "nvidia-l4"]) == 2
    assert "refinery prep: --gpu nvidia-l4: give --sdk_container_image" in capsys.readouterr().err
    assert main(["decon", "--eval", str(tmp_path / "in"), "--train", str(tmp_path / "in"), "--output", str(out),
                 "--runner", "dataflow", *GCP, "--gpu=nvidia-l4:0", f"--sdk_container_image={GPU_IMAGE}"]) == 2
    assert "refinery decon: --gpu 'nvidia-l4:0': expected TYPE or TYPE:COUNT" in capsys.readouterr().err
    assert not out.exists()  # nothing was planned or written


# ---------------------------------------------------------------------------------------
# Pipelines: one entry each (tiny inputs -> the resumable runs it would do)
# ---------------------------------------------------------------------------------------

@dataclass
class Jobs:
    """One resumable run of a pipeline: its stages and output, the steps of its one Beam job
    (its stages' titles, in order) and, for the inference pipelines, the model handler of
    their RunInference and the number of waves of infer units."""

    stages: list[Stage[Any, Any]]
    output: str
    steps: list[str]
    handler: str | None = None
    waves: int = 0


PREP_STEPS = ["Tokenize units", "Pack shards", "Write manifest"]


def prep_pipeline(root: Path) -> list[Jobs]:
    from refinery.transforms.io import storage
    from refinery.transforms.prep.stages import PrepConfig, build_stages

    write_jsonl(root / "in" / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(gsm8k_texts(6))])
    write_jsonl(root / "in" / "b.jsonl", [{"text": t} for t in gsm8k_texts(4, offset=6)])
    cfg = PrepConfig(inputs=storage.expand_inputs([str(root / "in")]), output=str(root / "out"), dataset="t",
                     num_shards=2)
    return [Jobs(build_stages(cfg), cfg.output, PREP_STEPS)]


def prep_mixture_pipeline(root: Path) -> list[Jobs]:
    """A one-source mixture with a train and a valid split: two prep runs, as ``_run_all`` does them."""
    from refinery.beam_pipelines.prep_mixture import split_stages
    from refinery.transforms.loader import mixture as mx

    write_jsonl(root / "corpus" / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(gsm8k_texts(6))])
    write_jsonl(root / "corpus" / "a_valid.jsonl", [{"text": t} for t in gsm8k_texts(2, offset=6)])
    (root / "mix.toml").write_text('''
data_root = "data"
[flows.tiny]
total_tokens_b = 0.000004
[mixtures.pretrain]
[[mixtures.pretrain.sources]]
id = "alpha"
percent = 100.0
path = "corpus/a.jsonl"
valid_path = "corpus/a_valid.jsonl"
''')
    mf = mx.load_mixture_file(str(root / "mix.toml"))
    mixture = mx.select_mixture(mf, "pretrain")
    assert mf.data_root is not None
    plans, skipped = mx.plan_mixture(mixture, mf.data_root, ["train", "valid"], mx.flow_target(mf, mixture, "tiny"))
    assert [p.label for p in plans] == ["alpha/train", "alpha/valid"] and not skipped
    jobs = []
    for plan in plans:
        cfg, stages = split_stages(plan, num_shards=2, workers=2)
        assert cfg.output == str(root / "data" / "alpha" / plan.split) and cfg.max_tokens == plan.budget
        jobs.append(Jobs(stages, cfg.output, PREP_STEPS))
    return jobs


def decon_pipeline(root: Path) -> list[Jobs]:
    from refinery.transforms.decon.stages import DeconSettings, build_stages

    write_jsonl(root / "eval" / "gsm8k" / "test.jsonl",
                [{"id": f"e{i}", "text": t} for i, t in enumerate(gsm8k_texts(3))])
    write_jsonl(root / "train" / "t.jsonl",
                [{"id": f"t{i}", "text": t} for i, t in enumerate(gsm8k_texts(5, offset=2))])
    settings = DeconSettings(eval_paths=[str(root / "eval")], train_paths=[str(root / "train")], ns=[5, 8],
                             partitions=4)
    output = str(root / "out")
    return [Jobs(build_stages(settings), output,
                 ["Read eval sets", "Index eval sets", "Scan training data", "Reduce partitions", "Merge reports"])]


# Inference pipelines: 3 documents, 2 per unit, 1 unit per wave -> 2 waves in the infer step.
# Their stages are built the way their commands build them (parsed CLI arguments).

def _inference_jobs(root: Path, command: str, argv: list[str], handler: str) -> list[Jobs]:
    pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
    from engine_fixtures import write_harmony_checkpoint

    from refinery.beam_pipelines import generate, hydra
    from refinery.transforms.inference.stages import build_stages

    ckpt = write_harmony_checkpoint(root / "ckpt", num_hidden_layers=1)
    common = ["--checkpoint", str(ckpt), "--output", str(root / "out"), "--device", "cpu", "--dtype", "float32",
              "--docs-per-unit", "2", "--wave-units", "1"]
    parser = generate.build_parser() if command == "generate" else hydra.build_parser()
    args, rest = parser.parse_known_args([*argv, *common])
    assert not rest
    flags = generate.EngineFlags.from_args(args)
    engine, options = generate.engine_settings(flags), generate.handler_options(flags)
    task: Task
    if command == "generate":
        from refinery.transforms.inference.handler import GenerationParams
        from refinery.transforms.inference.tasks import GenerateTask

        task = GenerateTask(engine, GenerationParams(max_tokens=args.max_tokens), args.template, options)
    elif command == "oracle-label":
        from refinery.transforms.hydra.oracle import OracleTask
        from refinery.transforms.inference.handler import GenerationParams

        task = OracleTask(engine, GenerationParams(max_tokens=args.max_tokens), options)
    else:
        from refinery.transforms.hydra.grade import GradeTask

        task = GradeTask(engine, args.heads_dir, args.calibration, args.max_ctx, options)
    stages = build_stages(task, generate.document_source(generate.InputFlags.from_args(args)), args.wave_units)
    return [Jobs(stages, args.output, ["Infer", "Merge outputs"], handler, waves=2)]


def _docids(root: Path, n: int) -> Path:
    """A doc-id file of ``n`` documents in a tiny .npy token shard under ``root/data``."""
    import numpy as np

    (root / "data" / "t").mkdir(parents=True)
    np.save(root / "data" / "t" / "shard.npy", np.arange(10 * n, dtype=np.uint32))
    path = root / "docids.jsonl"
    write_jsonl(path, [{"doc_id": f"t//t/shard.npy#s={10 * i}:e={10 * i + 10}"} for i in range(n)])
    return path


def generate_pipeline(root: Path) -> list[Jobs]:
    write_jsonl(root / "in" / "a.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(gsm8k_texts(3))])
    return _inference_jobs(root, "generate", ["--input", str(root / "in"), "--max-tokens", "4"],
                           "GptOssModelHandler")


def oracle_label_pipeline(root: Path) -> list[Jobs]:
    return _inference_jobs(root, "oracle-label", ["oracle-label", "--input-docids", str(_docids(root, 3)),
                                                  "--data-root", str(root / "data"), "--max-tokens", "4"],
                           "GptOssModelHandler")


def grade_pipeline(root: Path) -> list[Jobs]:
    """Heads and calibration are the real files (untrained heads of the checkpoint's width,
    saved by ``save_head``; a calibration fitted by ``calibrate`` on 20 score rows)."""
    pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
    import numpy as np
    from engine_fixtures import tiny_config

    from refinery.transforms.hydra.calibrate import calibrate, write_calibration
    from refinery.transforms.hydra.heads import JudgeHead, ProbeHead, load_head, save_head

    hidden = tiny_config().hidden_size
    save_head(str(root / "heads" / "hydra_probe.pt"), ProbeHead(hidden), "probe", 1, {})
    save_head(str(root / "heads" / "hydra_judge.pt"), JudgeHead(hidden, mid_dim=16), "judge", 1, {})
    assert load_head(str(root / "heads" / "hydra_judge.pt"))[1]["mid_dim"] == 16
    scores = np.random.default_rng(0).integers(0, 5, size=(20, 5)).astype(float)
    write_calibration(str(root / "cal"), calibrate(scores))
    return _inference_jobs(root, "grade", ["grade", "--input-docids", str(_docids(root, 3)), "--data-root",
                                           str(root / "data"), "--heads-dir", str(root / "heads"),
                                           "--calibration", str(root / "cal"), "--max-ctx", "64"],
                           "HydraGradeHandler")


PIPELINES: dict[str, Callable[[Path], list[Jobs]]] = {
    "prep": prep_pipeline,
    "prep-mixture": prep_mixture_pipeline,
    "decon": decon_pipeline,
    "generate": generate_pipeline,
    "hydra oracle-label": oracle_label_pipeline,
    "hydra grade": grade_pipeline,
}


# runner -> (our extra flags, the environment urn its workers get)
RUNNER_CASES = {
    "direct": ([], None),
    "local": ([], None),
    "portable": ([], "beam:env:embedded_python_loopback:v1"),
    "prism": ([], "beam:env:embedded_python_loopback:v1"),
    "flink": (["--flink_master=flink-jm:8081", f"--sdk_container_image={CPU_IMAGE}"], "beam:env:docker:v1"),
    # without --dry_run, building a DataflowRunner pipeline already asks GCS about the
    # temp bucket (Beam's option validation); --dry_run skips that
    "dataflow": ([*GCP, "--dry_run=True"], None),
}


def _unit_transforms(proto: beam_runner_api_pb2.Pipeline) -> list[beam_runner_api_pb2.PTransform]:
    """The transforms whose DoFns write units' receipts: ``<step>/Run`` of each step, and
    ``Infer/Wave k/Write`` of each wave of an inference pipeline."""
    from apache_beam.portability import common_urns

    return [t for t in proto.components.transforms.values()
            if t.spec.urn == common_urns.primitives.PAR_DO.urn and t.unique_name.endswith(("/Run", "/Write"))]


def _unpickled_dofn(transform: beam_runner_api_pb2.PTransform) -> Any:  # whichever DoFn the job carries
    from apache_beam.internal import pickler
    from apache_beam.portability.api import beam_runner_api_pb2

    payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
    return pickler.loads(payload.do_fn.payload)[0]  # (fn, args, kwargs, side inputs, windowing)


def _model_handlers(proto: beam_runner_api_pb2.Pipeline) -> list[str]:
    """Class name of the model handler inside the (keyed) RunInference DoFn of each wave."""
    from apache_beam.portability import common_urns

    handlers = []
    for t in proto.components.transforms.values():
        if "/Infer/" in t.unique_name and t.spec.urn == common_urns.primitives.PAR_DO.urn:
            fn = _unpickled_dofn(t)
            keyed = getattr(fn, "_model_handler", None)
            if keyed is not None:
                handlers.append(type(keyed._unkeyed).__name__)
    return handlers


def _check_job(proto: beam_runner_api_pb2.Pipeline, jobs: Jobs, bound: dict[str, StageRun], env_urn: str | None,
               image: str | None) -> None:
    """One job whose steps are the command's stages; each unit-writing DoFn carries the same
    stage run (name, hash, output, where its plan lies) as binding the stages does; its
    environment is the runner's."""
    from apache_beam.portability.api import beam_runner_api_pb2

    assert step_names(proto) == jobs.steps
    written = []
    for transform in _unit_transforms(proto):
        env = proto.components.environments[transform.environment_id]
        if env_urn is not None:
            assert env.urn == env_urn, transform.unique_name
        if image is not None:
            assert beam_runner_api_pb2.DockerPayload.FromString(env.payload).container_image == image
        fn = _unpickled_dofn(transform)
        expected = bound[fn.run.name]
        assert (fn.run.name, fn.run.stage_hash, fn.run.output) == (expected.name, expected.stage_hash, jobs.output)
        # the job carries where the plan lies in the output, not the plan (its size must not grow with it)
        assert fn.run.stage.plan_ref == expected.stage.plan_ref and expected.stage.plan_ref is not None \
            and expected.stage.plan_ref.units > 0
        assert fn.run.stage._units is None
        written.append((type(fn).__name__, fn.run.name))
    if jobs.handler:
        assert sorted(written) == [("RunUnitFn", "merge")] + [("WriteUnitFn", "infer")] * jobs.waves
        assert _model_handlers(proto) == [jobs.handler] * jobs.waves
    else:
        assert sorted(written) == sorted(("RunUnitFn", r.name) for r in bound.values())


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_each_command_is_one_job_for_each_runner(pipeline: str, tmp_path: Path, no_network: None) -> None:
    from refinery.transforms.resumable import bind_stages

    for jobs in PIPELINES[pipeline](tmp_path):
        bound = {r.name: r for r in bind_stages(jobs.stages, jobs.output)}
        for runner, (extra, env_urn) in RUNNER_CASES.items():
            built = command_pipeline(jobs.stages, jobs.output, pipeline_args(runner, 2, extra))
            assert built is not None  # the plan has units
            image = CPU_IMAGE if env_urn == "beam:env:docker:v1" else None
            _check_job(runner_api(built), jobs, bound, env_urn, image)
        assert not [f for f in Path(jobs.output).rglob("*") if f.is_file()], "building must not run units"
    assert no_network == []


# ---------------------------------------------------------------------------------------
# Dataflow --dry_run, with the network refused (fixture above)
# ---------------------------------------------------------------------------------------

def job_name(pipeline: str) -> str:
    return "refinery-" + pipeline.replace(" ", "-")


def _pool(job: Any) -> Any:  # Dataflow's job and worker pool messages: untyped
    pools = job.proto.environment.worker_pools
    assert len(pools) == 1
    return pools[0]


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_dataflow_dry_run_builds_each_job_offline(pipeline: str, tmp_path: Path, no_network: None) -> None:
    from refinery.transforms.resumable import bind_stages

    first_job = None
    for jobs in PIPELINES[pipeline](tmp_path):
        bound = {r.name: r for r in bind_stages(jobs.stages, jobs.output)}
        args = pipeline_args("dataflow", 7, [*GCP, f"--sdk_container_image={CPU_IMAGE}",
                                             "--machine_type=n2-standard-8", f"--job_name={job_name(pipeline)}"])
        job = dataflow_job(jobs.stages, jobs.output, args)
        env = job.proto.environment
        pool = _pool(job)
        assert job.proto.name == job_name(pipeline) and job.proto.type_.name == "JOB_TYPE_BATCH"
        assert pool.machine_type == "n2-standard-8" and pool.autoscaling_settings.max_num_workers == 7
        assert pool.worker_harness_container_image == CPU_IMAGE
        assert "workflow.tar.gz" in {p.name for p in pool.packages}  # the --setup_file sdist
        assert "use_runner_v2" in env.experiments
        assert env.temp_storage_prefix.startswith("storage.googleapis.com/refinery-test-bucket/tmp")
        _check_job(job.proto_pipeline, jobs, bound, "beam:env:docker:v1", CPU_IMAGE)
        assert not [f for f in Path(jobs.output).rglob("*") if f.is_file()], "a dry run must not run units"
        first_job = first_job or job
    # the sdist that workers would pip-install holds every package of this project
    assert first_job is not None
    names = _staged_sdist_names(first_job.proto_pipeline)
    for module in ("setup.py", "runners/dataflow.py", "transforms/resumable/__init__.py", "beam_pipelines/cli.py",
                   "kernels/model.py"):
        assert any(n.endswith(module) for n in names), module
    assert no_network == []


def _staged_sdist_names(proto_pipeline: beam_runner_api_pb2.Pipeline) -> list[str]:
    import tarfile

    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    for env in proto_pipeline.components.environments.values():
        for dep in env.dependencies:
            if dep.role_urn != common_urns.artifact_roles.STAGING_TO.urn:
                continue
            staged = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dep.role_payload).staged_name
            if staged == "workflow.tar.gz":
                path = beam_runner_api_pb2.ArtifactFilePayload.FromString(dep.type_payload).path
                with tarfile.open(path) as tar:
                    return tar.getnames()
    raise AssertionError("no workflow.tar.gz among the staged artifacts")


def test_dataflow_gpu_dry_run(tmp_path: Path, no_network: None) -> None:
    """The GPU flags reach the job description of generate's one job (any pipeline's are alike)."""
    [jobs] = generate_pipeline(tmp_path)
    args = pipeline_args("dataflow", 3, [*GCP, "--gpu", "nvidia-l4:2", f"--sdk_container_image={GPU_IMAGE}"])
    job = dataflow_job(jobs.stages, jobs.output, args)
    assert step_names(job.proto_pipeline) == ["Infer", "Merge outputs"]
    env, pool = job.proto.environment, _pool(job)
    assert list(env.service_options) == ["worker_accelerator=type:nvidia-l4;count:2;install-nvidia-driver"]
    assert "no_use_multiple_sdk_containers" in env.experiments
    assert "use_multiple_sdk_containers" not in env.experiments
    assert pool.machine_type == "g2-standard-24" and pool.worker_harness_container_image == GPU_IMAGE
    assert no_network == []


def test_progress_reads_each_completed_receipt_once(tmp_path: Path) -> None:
    """On GCS every read is a request: a progress poll re-reads only receipts not completed before."""
    from refinery.transforms.io import storage
    from refinery.transforms.resumable import Unit, bind_stages
    from refinery.transforms.resumable.ledger import RECEIPT_SCHEMA, Receipt

    class One(Stage[dict[str, Any], dict[str, int]]):
        name = "one"

        def make_plan(self) -> list[Unit[dict[str, Any]]]:
            return []

    [run] = bind_stages([One()], str(tmp_path))

    def receipt(unit: str, status: str, n: int) -> None:
        storage.atomic_write_json(run.receipt_path(unit), {"schema": RECEIPT_SCHEMA, "stage_hash": run.stage_hash,
                                                      "unit": unit, "status": status, "stats": {"n": n}})

    receipt("a", "completed", 1)
    receipt("b", "failed", 2)
    cache: dict[str, Receipt] = {}
    assert sorted((r["unit"], r["stats"]["n"]) for r in run.read_receipts(cache)) == [("a", 1), ("b", 2)]
    assert list(cache) == [run.receipt_path("a")]
    receipt("a", "completed", 10)  # not read again: the cached copy is used
    receipt("b", "completed", 20)  # a failed unit that completed since: read again
    receipt("c", "completed", 30)  # new
    assert sorted((r["unit"], r["stats"]["n"]) for r in run.read_receipts(cache)) == [("a", 1), ("b", 20), ("c", 30)]
    assert sorted((r["unit"], r["stats"]["n"]) for r in run.read_receipts()) == [("a", 10), ("b", 20), ("c", 30)]

