"""This project's ``setup.py``, which remote workers install (``--setup_file``)."""
from __future__ import annotations

from pathlib import Path


def setup_file() -> str | None:
    """Path of this project's setup.py when running from a source checkout, else None."""
    path = Path(__file__).resolve().parent.parent / "setup.py"
    return str(path) if path.exists() else None
