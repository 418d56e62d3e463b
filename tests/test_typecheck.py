"""The type checker of ``make lint`` catches a broken contract: a consumer that reads a key a
receipt does not have (a misspelled ``stats``) is an error, the right key is not."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''\
from refinery.transforms.resumable.ledger import Receipt


def stats_of(r: Receipt) -> object:
    return r["stats"]


def misspelled(r: Receipt) -> object:
    return r["stat"]
'''


@pytest.mark.timeout(120)
def test_mypy_reports_a_misspelled_receipt_key(tmp_path: Path) -> None:
    (tmp_path / "refinery").symlink_to(ROOT)  # the package `refinery` is the checkout (setup.py)
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), "--cache-dir",
         str(tmp_path / "cache"), "--follow-imports", "silent", "probe.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    errors = [ln for ln in proc.stdout.splitlines() if ": error:" in ln]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(errors) == 1 and errors[0].startswith("probe.py:9:"), proc.stdout
    assert 'TypedDict "Receipt" has no key "stat"' in errors[0]
