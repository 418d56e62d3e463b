"""Beam is imported without the connectors no command uses, and they import again afterwards."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from refinery.transforms.io.beam_import import SKIPPED, import_beam
import_beam()
assert "apache_beam" in sys.modules
left = [m for m in sys.modules if any(m == s or m.startswith(s + ".") for s in SKIPPED)]
assert not left, left
import apache_beam as beam
from apache_beam.runners.portability.fn_api_runner import fn_runner  # noqa: F401
with beam.Pipeline() as p:  # Beam still runs a job
    _ = p | beam.Create([1, 2]) | beam.Map(lambda x: x * 2)
import pandas  # refused only while Beam was imported
import pyarrow as pa
assert pa.table({"a": [1, 2]}).to_pandas().shape == (2, 1)  # pyarrow still finds pandas
print("ok")
"""


def test_beam_imports_without_the_skipped_connectors_and_they_import_after() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
    assert "bson" not in r.stderr  # Beam's mongodbio warning without pymongo is not shown
