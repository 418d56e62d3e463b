"""A finished portable job's data-plane hang-up is not printed as an error; a failed job's is."""
from __future__ import annotations

import logging
import threading

import grpc
import grpc.aio
import pytest

from refinery.runners.shutdown_noise import DATA_PLANE_LOGGER, held_shutdown_noise, is_cancelled


def _stream(code: grpc.StatusCode) -> BaseException:
    """A gRPC stream's error with status ``code``: grpc's own (an RpcError, as is_cancelled asks)."""
    error: BaseException = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata())
    return error


def _say(error: BaseException) -> None:
    """What Beam's data plane does when its stream ends: log the error, then end a thread on it."""
    try:
        raise error
    except type(error):
        logging.getLogger(DATA_PLANE_LOGGER).exception("Failed to read inputs in the data plane.")

    def reader() -> None:
        raise error

    t = threading.Thread(target=reader, name="read_grpc_client_inputs")
    t.start()
    t.join()


@pytest.fixture
def thread_ends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that ended on an exception, as the process's excepthook saw them."""
    ended: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.append(args.thread.name))
    return ended


def test_a_hung_up_data_plane_is_dropped_when_the_job_succeeds(
        caplog: pytest.LogCaptureFixture, thread_ends: list[str]) -> None:
    hook = threading.excepthook
    with caplog.at_level(logging.ERROR):
        with held_shutdown_noise():
            _say(_stream(grpc.StatusCode.CANCELLED))
    assert caplog.records == [] and thread_ends == []
    assert threading.excepthook is hook  # put back


def test_a_hung_up_data_plane_is_said_when_the_job_fails(
        caplog: pytest.LogCaptureFixture, thread_ends: list[str]) -> None:
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        with held_shutdown_noise():
            _say(_stream(grpc.StatusCode.CANCELLED))
            assert caplog.records == [] and thread_ends == []  # held while the job runs
            raise RuntimeError("the job failed")
    assert [r.getMessage() for r in caplog.records] == ["Failed to read inputs in the data plane."]
    assert thread_ends == ["read_grpc_client_inputs"]


def test_any_other_data_plane_error_is_said_at_once(caplog: pytest.LogCaptureFixture, thread_ends: list[str]) -> None:
    with caplog.at_level(logging.ERROR):
        with held_shutdown_noise():
            _say(_stream(grpc.StatusCode.UNAVAILABLE))
            assert len(caplog.records) == 1 and thread_ends == ["read_grpc_client_inputs"]  # not held
    assert not is_cancelled(RuntimeError("CANCELLED")) and is_cancelled(_stream(grpc.StatusCode.CANCELLED))
