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

import pytest

pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

PROBE = r'''
import multiprocessing.managers as mm, os, pickle, stat, sys
from apache_beam.utils import multi_process_shared as mps
from refinery.transforms.inference.handler import EngineSettings
from refinery.transforms.inference.model_handler import GptOssModelHandler

class Counter:
    def __init__(self): self.n = 0
    def inc(self): self.n += 1; return self.n

if __name__ == "__main__":
    handler = pickle.loads(bytes.fromhex(sys.argv[1]))   # as a worker gets it
    assert handler.share_model_across_processes()          # what RunInference asks first
    folder = mps.MultiProcessShared.__init__.__kwdefaults__["path"]
    counter = mps.MultiProcessShared(Counter, tag="probe", always_proxy=True).acquire()
    assert counter.inc() == 1
    host, port = open(os.path.join(folder, "probe.address")).read().split(":")
    try:
        mm.BaseManager(address=(host, int(port)), authkey=b"mps").connect()
        print("beam's default key connected")
    except Exception:  # multiprocessing.AuthenticationError
        print("default key refused")
    mm.BaseManager(address=(host, int(port)), authkey=handler._sharing_secret).connect()
    print("run key ok", oct(stat.S_IMODE(os.stat(folder).st_mode)), folder)
'''


def test_shared_model_server_takes_only_the_runs_key(tmp_path):
    from refinery.transforms.inference.handler import EngineSettings
    from refinery.transforms.inference.model_handler import GptOssModelHandler

    handler = GptOssModelHandler(EngineSettings(str(tmp_path)))
    other = GptOssModelHandler(EngineSettings(str(tmp_path)))  # a later wave of the same run: the same key
    assert handler._sharing_secret == other._sharing_secret and len(handler._sharing_secret) == 32
    another_driver = subprocess.run([sys.executable, "-c", "from refinery.transforms.inference.handler import "
                                     "sharing_secret; print(sharing_secret().hex())"], capture_output=True, text=True)
    assert bytes.fromhex(another_driver.stdout.strip()) != handler._sharing_secret
    script = tmp_path / "probe_script.py"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, str(script), pickle.dumps(handler).hex()], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "default key refused"
    mode, folder = lines[1].split()[-2:]
    assert mode == "0o700" and folder.startswith(str(tmp_path / f"refinery-mps-{os.getuid()}-"))
    assert not list(tmp_path.glob("probe.address")) and not list(tmp_path.glob("probe.lock"))  # not in TMPDIR itself


def test_a_folder_someone_else_prepared_is_refused(tmp_path, monkeypatch):
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
