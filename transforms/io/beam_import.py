"""Import Beam without the connectors no refinery command uses.

``import apache_beam`` imports every IO Beam ships whose library is installed: pandas (for
DataFrame type hints), pymongo (MongoDB), BigQuery, Pub/Sub and the cross-language IOs. In
this environment that is 0.4-0.8 s of a command's start-up (measured: ``import apache_beam``
1.26-1.82 s, 0.84-1.05 s without them), paid by every command on every run, for code no
command calls. :func:`import_beam` imports Beam with those modules refused (each guarded by
Beam with ``except ImportError``), then lets them be imported again: a later ``import
pandas`` or Dataflow's own BigQuery import works as always. Beam's ``gs://`` filesystem is
not refused (the Dataflow runner stages files with it).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Sequence

# refused while Beam is imported; Beam imports each inside ``try: ... except ImportError``
SKIPPED = ("pandas", "pymongo", "bson", "apache_beam.io.gcp.bigquery", "apache_beam.io.gcp.pubsub",
           "apache_beam.transforms.xlang.io")
_BSON_WARNING = "Could not find a compatible bson package"  # what Beam's mongodbio logs without them
_MONGODBIO = "apache_beam.io.mongodbio"  # (its logger)


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == name or fullname.startswith(name + ".") for name in SKIPPED):
            raise ModuleNotFoundError(f"{fullname}: not imported with Beam by refinery", name=fullname)
        return None


def _not_bson_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BSON_WARNING)


def import_beam() -> None:
    """Import ``apache_beam`` (once per process) without :data:`SKIPPED`."""
    if "apache_beam" in sys.modules:
        return
    refuse, mongodbio = _Refuse(), logging.getLogger(_MONGODBIO)
    sys.meta_path.insert(0, refuse)
    mongodbio.addFilter(_not_bson_warning)
    try:
        import apache_beam  # noqa: F401
    finally:
        sys.meta_path.remove(refuse)
        mongodbio.removeFilter(_not_bson_warning)
