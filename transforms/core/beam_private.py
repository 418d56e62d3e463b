"""Where refinery reads or rewrites Beam's private names, each behind one function.

Beam gives no public way to do these two things, so this module does them through Beam's
internals, and ``tests/test_beam_private.py`` pins the Beam versions they were checked
against (:data:`CHECKED_BEAM`): a Beam upgrade fails that test first, naming what moved.
(The local runner, ``runners/local_runner.py`` and ``runners/warm_workers.py``, also builds
on Beam's FnApiRunner and SDK worker, through their public names; ``test_runners`` and
``test_warm_workers`` run them.)

- :func:`secure_shared_models`: Beam's shared-model server
  (``apache_beam.utils.multi_process_shared``, used by RunInference to share one model
  between worker processes) authenticates with a fixed key (``b"mps"``) and keeps its
  address files under a predictable name in ``/tmp``: any local user could connect and have
  a pickle unpickled in the server. refinery gives it a random per-driver key and a private
  folder (``transforms/inference/handler.py``).
- :func:`fnapi_environment_major_version`: what Beam's Dataflow client sends as the SDK
  environment version, for the offline ``--dry-run`` job description
  (``runners/translate.py``).
"""
from __future__ import annotations

CHECKED_BEAM = ("2.77",)  # major.minor versions of apache-beam these functions were checked against


def secure_shared_models(secret: bytes, folder: str) -> None:
    """Make this process's shared-model server (client and server side) authenticate with
    ``secret`` and keep its address and lock files in ``folder``."""
    from apache_beam.utils import multi_process_shared

    multi_process_shared.AUTH_KEY = secret
    multi_process_shared.MultiProcessShared.__init__.__kwdefaults__["path"] = folder


def shared_models_setting() -> tuple[bytes, str]:
    """(key, folder) the shared-model server of this process uses now."""
    from apache_beam.utils import multi_process_shared

    return multi_process_shared.AUTH_KEY, multi_process_shared.MultiProcessShared.__init__.__kwdefaults__["path"]


def fnapi_environment_major_version() -> str:
    """The SDK environment major version Beam's Dataflow client puts in a job description."""
    from apache_beam.runners.dataflow.internal import apiclient

    return apiclient._FNAPI_ENVIRONMENT_MAJOR_VERSION
