"""A finished portable job's data-plane hang-up is not printed as an error; a failed job's is."""
from __future__ import annotations

import logging
import threading

import grpc
import pytest

from refinery.runners.shutdown_noise import DATA_PLANE_LOGGER, held_shutdown_noise, is_cancelled


class _Stream(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def _say(error: BaseException) -> None:
    """What Beam's data plane does when its stream ends: log the error, then end a thread on it."""
    try:
        raise error
    except type(error):
        logging.getLogger(DATA_PLANE_LOGGER).exception("Failed to read inputs in the data plane.")

    def reader():
        raise error

    t = threading.Thread(target=reader, name="read_grpc_client_inputs")
    t.start()
    t.join()


@pytest.fixture
def thread_ends(monkeypatch) -> list[str]:
    """The names of the threads that ended on an exception, as the process's excepthook saw them."""
    ended: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.append(args.thread.name))
    return ended


def test_a_hung_up_data_plane_is_dropped_when_the_job_succeeds(caplog, thread_ends):
    hook = threading.excepthook
    with caplog.at_level(logging.ERROR):
        with held_shutdown_noise():
            _say(_Stream(grpc.StatusCode.CANCELLED))
    assert caplog.records == [] and thread_ends == []
    assert threading.excepthook is hook  # put back


def test_a_hung_up_data_plane_is_said_when_the_job_fails(caplog, thread_ends):
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        with held_shutdown_noise():
            _say(_Stream(grpc.StatusCode.CANCELLED))
            assert caplog.records == [] and thread_ends == []  # held while the job runs
            raise RuntimeError("the job failed")
    assert [r.getMessage() for r in caplog.records] == ["Failed to read inputs in the data plane."]
    assert thread_ends == ["read_grpc_client_inputs"]


def test_any_other_data_plane_error_is_said_at_once(caplog, thread_ends):
    with caplog.at_level(logging.ERROR):
        with held_shutdown_noise():
            _say(_Stream(grpc.StatusCode.UNAVAILABLE))
            assert len(caplog.records) == 1 and thread_ends == ["read_grpc_client_inputs"]  # not held
    assert not is_cancelled(RuntimeError("CANCELLED")) and is_cancelled(_Stream(grpc.StatusCode.CANCELLED))
