"""Checks on ``gs://`` paths that the driver makes before anything runs, without the network.

- :func:`bucket_problem`: the bucket of a ``gs://`` path against Cloud Storage's naming
  rules (3-63 characters, or up to 222 with dots; lowercase letters, digits, ``-``, ``_``,
  ``.``; a letter or digit at each end; not an IP address; no ``goog`` prefix, no
  ``google``). A bad name would otherwise be found by a request that fails after retries.
- :func:`credentials_problem`: whether Google's default credentials can be found, looked up
  the way ``google.auth.default()`` looks, minus its network probe: without credentials,
  gcsfs falls back to anonymous requests and retries them for minutes.
"""
from __future__ import annotations

import os
import re

LOGIN = "gcloud auth application-default login"

_BUCKET_CHARS = re.compile(r"[a-z0-9][-_.a-z0-9]*[a-z0-9]")
_IP = re.compile(r"\d{1,3}(\.\d{1,3}){3}")


def bucket_of(path: str) -> str:
    """``gs://BUCKET/any/path`` -> ``BUCKET``."""
    return path.split("://", 1)[1].split("/", 1)[0]


def bucket_problem(path: str) -> str | None:
    """Why the bucket of the ``gs://`` path ``path`` cannot exist, or None if its name is valid."""
    bucket = bucket_of(path)
    rule = None
    if not bucket:
        rule = "no bucket name"
    elif not 3 <= len(bucket) <= (222 if "." in bucket else 63):
        rule = f"{len(bucket)} characters (a bucket name has 3 to 63, or up to 222 with dots)"
    elif not _BUCKET_CHARS.fullmatch(bucket):
        rule = "lowercase letters, digits, '-', '_' and '.' only, with a letter or digit at each end"
    elif any(len(part) > 63 or not part for part in bucket.split(".")):
        rule = "each dot-separated part has 1 to 63 characters"
    elif _IP.fullmatch(bucket):
        rule = "an IP address is not a bucket name"
    elif bucket.startswith("goog") or "google" in bucket:
        rule = "a bucket name cannot start with 'goog' or contain 'google'"
    if rule is None:
        return None
    return f"{path}: invalid bucket name {bucket!r}: {rule}"


def _adc_file() -> str:
    """Where ``gcloud auth application-default login`` writes its credentials."""
    config = os.environ.get("CLOUDSDK_CONFIG")
    if not config:
        if os.name == "nt":
            config = os.path.join(os.environ.get("APPDATA", ""), "gcloud")
        else:
            config = os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    return os.path.join(config, "application_default_credentials.json")


def _on_google_cloud() -> bool:
    """On a Google Cloud VM (its metadata server gives the credentials): the DMI product
    name says so, or the environment names a metadata server."""
    if os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP"):
        return True
    try:
        with open("/sys/class/dmi/id/product_name") as f:
            return f.read().strip().startswith("Google")
    except OSError:
        return False


def credentials_problem() -> str | None:
    """Why a ``gs://`` access would have no credentials, naming the fix; None when they can
    be found (or are not needed: a storage emulator, or a gcsfs token configured through
    fsspec, e.g. ``FSSPEC_GCS_TOKEN=anon`` for public buckets)."""
    import fsspec.config

    if os.environ.get("STORAGE_EMULATOR_HOST") or fsspec.config.conf.get("gcs", {}).get("token"):
        return None
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key:
        if os.path.isfile(key):
            return None
        return (f"GOOGLE_APPLICATION_CREDENTIALS names {key}, which is not a file: fix or unset it "
                f"(then run `{LOGIN}`)")
    if os.path.isfile(_adc_file()) or _on_google_cloud():
        return None
    return (f"no Google Cloud credentials for gs:// (none in GOOGLE_APPLICATION_CREDENTIALS or {_adc_file()}, "
            f"and not on a Google Cloud VM): run `{LOGIN}`")
