"""The shared-model server RunInference starts is private to the run: a random key, a 0700 folder.

Beam's default (``apache_beam.utils.multi_process_shared``) authenticates with the fixed key
``b"mps"`` and writes its address under a predictable name in /tmp, so any local user could
connect and have a pickle unpickled in the process serving the engine."""
from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

PROBE = r"""
import multiprocessing.managers as mm, os, pickle, stat, sys, tempfile
import apache_beam as beam
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.options.pipeline_options import PipelineOptions
from refinery.transforms.io.beam_private import shared_models_setting
from refinery.transforms.inference.model_handler import KeyedGptOssModelHandler

DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def infer(keyed, tag):
    with beam.Pipeline(options=PipelineOptions(DIRECT)) as p:
        _ = p | beam.Create([("a", {"tokens": [5, 6, 7]}), ("b", [9] * 4)]) | RunInference(keyed, model_identifier=tag)


if __name__ == "__main__":
    handler = pickle.loads(bytes.fromhex(sys.argv[1]))   # as a worker gets it
    beams = (b"mps", tempfile.gettempdir())
    assert shared_models_setting() == beams
    assert handler.share_model_across_processes() is True  # the predicate: a bool, and nothing else
    assert shared_models_setting() == beams
    try:  # Beam's own KeyedModelHandler does not pass the worker setup on: no engine behind Beam's key
        infer(KeyedModelHandler(handler), "unsecured")
        print("loaded behind beam's key")
    except Exception as e:
        print("unsecured load refused" if "not private to the run" in str(e) else f"other error {e!r}")
    assert shared_models_setting() == beams
    infer(KeyedGptOssModelHandler(handler), "probe")        # RunInference's worker setup secures it, then loads
    key, folder = shared_models_setting()
    assert key == handler._sharing_secret
    host, port = open(os.path.join(folder, "probe0.address")).read().split(":")  # the engine's server (copy 0)
    try:
        mm.BaseManager(address=(host, int(port)), authkey=b"mps").connect()
        print("beam's default key connected")
    except Exception:  # multiprocessing.AuthenticationError
        print("default key refused")
    mm.BaseManager(address=(host, int(port)), authkey=handler._sharing_secret).connect()
    print("run key ok", oct(stat.S_IMODE(os.stat(folder).st_mode)), folder)
"""


def test_shared_model_server_takes_only_the_runs_key(tmp_path: Path) -> None:
    """In a fresh process, as a worker: asking the handler whether it shares its model changes
    nothing; RunInference's worker setup makes the sharing private, and the engine is then
    loaded once and served from a server that takes only the run's key, in a 0700 folder."""
    from engine_fixtures import write_harmony_checkpoint

    from refinery.transforms.inference.handler import EngineSettings
    from refinery.transforms.inference.model_handler import GptOssModelHandler

    ckpt = write_harmony_checkpoint(tmp_path / "tiny", num_hidden_layers=1)
    settings = EngineSettings(str(ckpt), dtype="float32", max_batch=2, max_seq_len=64, block_size=8, prefill_chunk=16)
    handler = GptOssModelHandler(settings)
    other = GptOssModelHandler(settings)  # a later wave of the same run: the same key
    assert handler._sharing_secret == other._sharing_secret and len(handler._sharing_secret) == 32
    another_driver = subprocess.run([sys.executable, "-c", "from refinery.transforms.inference.handler import "
                                     "sharing_secret; print(sharing_secret().hex())"], capture_output=True, text=True)
    assert bytes.fromhex(another_driver.stdout.strip()) != handler._sharing_secret
    script = tmp_path / "probe_script.py"
    script.write_text(PROBE)
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.run([sys.executable, str(script), pickle.dumps(handler).hex()], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["unsecured load refused", "default key refused"], lines
    mode, folder = lines[2].split()[-2:]
    assert mode == "0o700" and folder.startswith(str(temp / f"refinery-mps-{os.getuid()}-"))
    served = sorted(p.name for p in Path(folder).iterdir())  # the engine (copy 0) and Beam's status of it
    assert served == ["probe0.address", "probe0.lock", "probe_model_status.address", "probe_model_status.lock"]
    assert not list(temp.glob("probe*"))  # not in TMPDIR itself (the refused run's Beam status server is)


def test_securing_is_idempotent_and_pure_predicates_stay_pure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The predicate RunInference asks (also in the driver, to build the job) has no side
    effect; the worker setup applies the sharing settings, and applying them again changes
    nothing; without sharing, the setup leaves Beam's settings alone."""
    import tempfile

    from apache_beam.utils import multi_process_shared as mps

    from refinery.transforms.inference.handler import EngineSettings, sharing_is_secured
    from refinery.transforms.inference.model_handler import GptOssModelHandler, KeyedGptOssModelHandler
    from refinery.transforms.io.beam_private import shared_models_setting

    monkeypatch.setattr(mps, "AUTH_KEY", mps.AUTH_KEY)  # restored after the test
    kwdefaults = mps.MultiProcessShared.__init__.__kwdefaults__
    assert kwdefaults is not None
    monkeypatch.setitem(kwdefaults, "path", kwdefaults["path"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = shared_models_setting()
    alone = KeyedGptOssModelHandler(GptOssModelHandler(EngineSettings(str(tmp_path)), share_across_processes=False))
    shared = KeyedGptOssModelHandler(GptOssModelHandler(EngineSettings(str(tmp_path))))
    assert shared.share_model_across_processes() is True and alone.share_model_across_processes() is False
    assert shared_models_setting() == before
    alone.set_environment_vars()
    assert shared_models_setting() == before
    secret = shared.unkeyed._sharing_secret
    assert not sharing_is_secured(secret)
    shared.set_environment_vars()
    secured = shared_models_setting()
    assert secured[0] == secret and sharing_is_secured(secret)
    shared.set_environment_vars()
    assert shared_models_setting() == secured


def test_a_folder_someone_else_prepared_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from refinery.transforms.inference.handler import sharing_folder

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    secret = b"k" * 32
    planted = tmp_path / f"refinery-mps-{os.getuid()}-{hashlib.sha256(secret).hexdigest()[:16]}"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    with pytest.raises(RuntimeError, match="not a private folder"):
        sharing_folder(secret)
    os.chmod(planted, 0o700)
    assert sharing_folder(secret) == str(planted) and stat.S_IMODE(planted.stat().st_mode) == 0o700
