"""refinery's uses of Beam's private parts (transforms/io/beam_private.py) still work with
the installed Beam, and that Beam is one they were checked against."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import apache_beam
import pytest

from refinery.transforms.io import beam_private


def test_the_installed_beam_is_one_the_private_hooks_were_checked_against() -> None:
    major_minor = ".".join(apache_beam.__version__.split(".")[:2])
    assert major_minor in beam_private.CHECKED_BEAM, (
        f"apache-beam {apache_beam.__version__}: check transforms/io/beam_private.py against it "
        f"(the shared-model key and folder, the Dataflow environment version, the FnApiRunner servers' address, "
        f"the LOOPBACK worker pool's address, the dead-letter error, the setup_file sdist build), "
        f"then add it to CHECKED_BEAM")


def test_the_shared_model_server_takes_the_key_and_folder(tmp_path: Path) -> None:
    from apache_beam.utils import multi_process_shared

    before = beam_private.shared_models_setting()
    try:
        beam_private.secure_shared_models(b"k" * 32, str(tmp_path))
        assert beam_private.shared_models_setting() == (b"k" * 32, str(tmp_path))
        shared: multi_process_shared.MultiProcessShared[dict[str, Any]] = multi_process_shared.MultiProcessShared(
            dict, tag="refinery-test-beam-private")
        assert shared._path == str(tmp_path)  # where a new sharer puts its address and lock files
    finally:
        beam_private.secure_shared_models(*before)


def test_the_dataflow_environment_version_is_a_version() -> None:
    assert beam_private.fnapi_environment_major_version().isdigit()


def test_the_fn_api_servers_listen_where_they_are_told(tmp_path: Path) -> None:
    """Beam's FnApiRunner builds its four worker servers through ``worker_handlers.grpc``:
    inside ``fn_api_servers_at`` each listens at the address given (a unix socket here, or
    loopback), and its port is the address a worker reaches it at."""
    from apache_beam.runners.portability.fn_api_runner import worker_handlers
    from apache_beam.runners.portability.fn_api_runner.fn_runner import ExtendedProvisionInfo

    real = vars(worker_handlers)["grpc"]
    addresses = iter([f"unix:{tmp_path}/{i}.sock" for i in range(3)] + ["127.0.0.1:0"])
    with beam_private.fn_api_servers_at(lambda: next(addresses)):
        server = worker_handlers.GrpcServer(worker_handlers.StateServicer(), None,
                                            worker_handlers.WorkerHandlerManager({}, ExtendedProvisionInfo()))
    try:
        assert vars(worker_handlers)["grpc"] is real
        assert [server.control_port, server.data_port, server.state_port] == [
            f"unix:{tmp_path}/{i}.sock" for i in range(3)]
        assert all((tmp_path / f"{i}.sock").is_socket() for i in range(3))
        host, port = server.logging_port.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        server.close()


class Refused(ValueError):
    pass


def test_a_dead_letter_says_the_error_type_and_message() -> None:
    """What ``with_exception_handling`` puts beside a failed input reads as ``Type: message``
    (RunInference's ``failed_inferences`` are made the same way: a failed batch's units)."""
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    def check(x: int) -> int:
        if x == 2:
            raise Refused(f"no {x}\nsecond line")
        if x == 3:
            raise KeyError(x)
        return x

    with beam.Pipeline() as p:
        _good, bad = p | beam.Create([1, 2, 3]) | beam.Map(check).with_exception_handling()
        said = bad | beam.MapTuple(lambda x, error: (x, beam_private.dead_letter_error(error)))
        assert_that(said, equal_to([(2, "Refused: no 2\nsecond line"), (3, "KeyError: 3")]))


def test_a_setup_file_build_inside_prints_nothing_and_a_failed_one_says_why(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Beam's stager builds the ``--setup_file`` sdist (``Stager._build_setup_package``):
    inside ``setup_builds_captured`` the build's progress is not printed, and a build that
    fails is a RuntimeError that carries what it printed."""
    from apache_beam.runners.portability.stager import Stager

    for name, body in [("good", "setup(name='p', version='1', py_modules=[])"),
                       ("bad", "raise SystemExit('this setup.py is broken on purpose')")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "setup.py").write_text(f"from setuptools import setup\n{body}\n")
    with beam_private.setup_builds_captured():
        built = Stager._build_setup_package(str(tmp_path / "good" / "setup.py"), str(tmp_path), None)
        assert Path(built).is_file()
        assert capfd.readouterr().err == ""
        with pytest.raises(RuntimeError, match="broken on purpose"):
            Stager._build_setup_package(str(tmp_path / "bad" / "setup.py"), str(tmp_path), None)


def test_the_provision_info_carries_the_options() -> None:
    from apache_beam.options.pipeline_options import PipelineOptions

    info = beam_private.provision_info(PipelineOptions(["--job_name=probe-job"]))
    assert info.provision_info.pipeline_options.fields["beam:option:job_name:v1"].string_value == "probe-job"


def test_the_flink_job_server_records_its_endpoint(tmp_path: Path) -> None:
    from apache_beam.options.pipeline_options import PipelineOptions

    jar = tmp_path / "job-server.jar"
    jar.write_bytes(b"")
    server = beam_private.flink_job_server(PipelineOptions([f"--flink_job_server_jar={jar}", "--flink_master=[local]"]))
    cmd, endpoint = server.subprocess_cmd_and_endpoint()  # what start() calls; nothing is started here
    assert server.endpoint == endpoint and endpoint.startswith("localhost:") and str(jar) in cmd


def test_shared_subprocess_servers_is_a_context() -> None:
    with beam_private.shared_subprocess_servers():
        pass


def test_beam_knows_its_runners_and_options() -> None:
    assert {"directrunner", "flinkrunner", "prismrunner"} <= beam_private.beam_runner_names()
    assert {"--runner", "--temp_location", "--job_name"} <= beam_private.beam_option_flags()


def test_argparse_actions_flags_and_subcommands() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-shards")
    sub = parser.add_subparsers(dest="cmd")
    child = sub.add_parser("grade")
    assert {"--num-shards", "-h", "--help"} <= beam_private.option_flags(parser)
    assert [a.dest for a in beam_private.parser_actions(parser)][:2] == ["help", "num_shards"]
    assert beam_private.subcommands(parser) == [("cmd", {"grade": child})]


def test_the_loopback_worker_pool_listens_where_it_is_told() -> None:
    """Beam's PortableRunner starts a LOOPBACK environment's worker pool with
    ``BeamFnExternalWorkerPoolServicer.start`` (on ``[::]``, any caller): inside
    ``loopback_worker_pool_at`` it listens on the host given, behind the interceptors given."""
    import grpc
    from apache_beam.runners.worker import worker_pool_main

    seen: list[str] = []

    class Record:  # a gRPC server interceptor: gRPC calls its intercept_service (grpc's classes are untyped)
        def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
            seen.append(details.method)
            return continuation(details)

    pool = worker_pool_main.BeamFnExternalWorkerPoolServicer
    real = pool.start
    with beam_private.loopback_worker_pool_at("127.0.0.1", [Record()]):
        # as PortableRunner.start_and_replace_loopback_environments calls it (Beam 2.77)
        address, server = pool.start(state_cache_size=0, data_buffer_time_limit_ms=0, use_process=False)
    try:
        assert pool.start == real
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        method = "/org.apache.beam.model.fn_execution.v1.BeamFnExternalWorkerPool/StopWorker"
        with grpc.insecure_channel(address) as channel:
            assert channel.unary_unary(method)(b"", timeout=10) == b""
        assert seen == [method]
    finally:
        server.stop(0)
