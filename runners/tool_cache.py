"""What the runner tools refinery fetches or builds here (Flink's job server and distribution,
Prism's binary) have in common: where their cache is, the Beam they are for, a free port."""
from __future__ import annotations

import os
import socket
from pathlib import Path


def cache_dir(name: str, env: str) -> Path:
    """Where tool ``name`` lives: ``$env``; else, in a source checkout, its git-ignored
    ``.cache/NAME``; else ``~/.cache/refinery/NAME``."""
    if os.environ.get(env):
        return Path(os.environ[env])
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "setup.py").exists() and (checkout / ".git").exists():
        return checkout / ".cache" / name
    return Path.home() / ".cache" / "refinery" / name


def installed_beam_version() -> str:
    import apache_beam

    return apache_beam.__version__


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
