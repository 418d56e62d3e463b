"""Hugging Face datasets as inputs, each at a pinned revision.

- prep: ``resolve_hf_parquet(name, subset, split, revision)`` asks the hub once for the
  revision's commit sha and lists the parquet files of that subset and split through
  huggingface_hub's ``hf://`` filesystem. The sha goes into the plan, so a rerun reads the
  same files even if the dataset moves on; pass ``--hf-revision SHA`` to pin it without
  asking the hub.
- decon eval sets: ``materialize_split("NAME[:SUBSET]:SPLIT", folder)`` loads the split with
  ``datasets.load_dataset`` at the pinned revision and writes it once as a parquet file named
  by that revision; the decon plan then reads that file like any other eval file. NAME may
  be a hub dataset or a local dataset folder (its "revision" is a hash of its files).

A hub that cannot be reached is one clear error line (:class:`HubError`), not a traceback.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from refinery.transforms.io import storage

T = TypeVar("T")


class HubError(storage.InputError):
    """The Hugging Face hub could not answer (offline, unreachable, unknown dataset)."""


def _hub_call(what: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - requests/httpx/hf errors alike: one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise HubError(f"Hugging Face hub: {what}: {type(e).__name__}: {first[:300]} "
                       f"(no network? set HF_ENDPOINT, or use local files)") from None


@dataclass(frozen=True)
class HfSource:
    name: str
    subset: str | None
    split: str
    revision: str  # commit sha
    files: tuple[str, ...]  # hf:// paths

    def describe(self) -> dict[str, Any]:
        return {"hf_dataset": self.name, "hf_subset": self.subset, "hf_split": self.split,
                "hf_revision": self.revision}


def candidate_globs(subset: str | None, split: str) -> list[str]:
    """Where parquet files of a subset/split live in common hub layouts, most specific first."""
    pats = []
    if subset:
        pats += [f"{subset}/{split}/*.parquet", f"{subset}/{split}-*.parquet", f"data/{subset}/{split}-*.parquet",
                 f"{subset}/**/{split}-*.parquet", f"{subset}/*.parquet", f"{subset}/**/*.parquet"]
        if "-" in subset:  # e.g. fineweb-edu's config sample-10BT lives in sample/10BT/
            pats.append(f"{subset.replace('-', '/', 1)}/*.parquet")
    pats += [f"data/{split}-*.parquet", f"{split}/*.parquet", f"**/{split}-*.parquet", f"default/{split}/*.parquet"]
    return pats


def resolve_hf_parquet(name: str, subset: str | None, split: str, revision: str | None = None,
                       fs: Any = None, api: Any = None) -> HfSource:
    """The parquet files of ``name``/``subset``/``split``; raises ValueError naming what was tried."""
    if fs is None or (api is None and revision is None):
        from huggingface_hub import HfApi, HfFileSystem
        fs = fs or HfFileSystem()
        api = api or HfApi()
    sha = revision if revision and len(revision) == 40 else \
        _hub_call(f"resolving {name}", lambda: api.dataset_info(name, revision=revision).sha)
    tried = []
    for ref in (sha, "refs%2Fconvert%2Fparquet"):
        root = f"datasets/{name}@{ref}"
        for pat in candidate_globs(subset, split):
            tried.append(f"{root}/{pat}")
            found = sorted(_hub_call(f"listing {name}", lambda: fs.glob(f"{root}/{pat}")))
            if found:
                return HfSource(name, subset, split, sha, tuple(f"hf://{p}" for p in found))
    raise ValueError(f"no parquet files for {name} subset={subset} split={split} at {sha}; tried: "
                     + ", ".join(tried))


# ---------------------------------------------------------------------------------------
# decon eval sets by name
# ---------------------------------------------------------------------------------------

def parse_split_spec(spec: str) -> tuple[str, str | None, str]:
    """``NAME:SPLIT`` or ``NAME:SUBSET:SPLIT`` -> (name, subset or None, split)."""
    parts = spec.rsplit(":", 2) if spec.count(":") >= 2 else spec.rsplit(":", 1)
    if len(parts) < 2 or not all(parts):
        raise ValueError(f"--eval-hf {spec!r}: expected NAME:SPLIT or NAME:SUBSET:SPLIT (e.g. openai/gsm8k:main:test)")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def local_revision(folder: str) -> str:
    """A local dataset folder's "revision": sha1 over its files' (relative path, size, mtime)."""
    h = hashlib.sha1()
    for dirpath, dirnames, filenames in sorted(os.walk(folder)):
        dirnames.sort()
        for name in sorted(filenames):
            st = os.stat(os.path.join(dirpath, name))
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "dataset"


def materialize_split(spec: str, folder: str, revision: str | None = None, api: Any = None,
                      write: bool = True) -> str:
    """The path of a parquet file holding the ``NAME[:SUBSET]:SPLIT`` rows at a pinned revision,
    written under ``folder`` on first use (``{folder}/{key}/{short name}/{split}.parquet``, so
    that decon names the eval dataset after the dataset's short name). ``write=False``: only
    the path (a dry run)."""
    name, subset, split = parse_split_spec(spec)
    local = os.path.isdir(name)
    if local:
        sha = local_revision(name)
    elif revision and len(revision) == 40:
        sha = revision
    else:
        if api is None:
            from huggingface_hub import HfApi
            api = HfApi()
        sha = _hub_call(f"resolving {name}", lambda: api.dataset_info(name, revision=revision).sha)
    short = _safe(os.path.basename(name.rstrip("/")))
    key = f"{_safe(name)}-{_safe(subset or 'default')}-{_safe(split)}-{sha[:12]}"
    target = storage.join(folder, key, short, f"{_safe(split)}.parquet")
    if storage.exists(target) or not write:
        return target
    import datasets

    ds = _hub_call(f"loading {spec}", lambda: datasets.load_dataset(
        name, subset, split=split, revision=None if local else sha))
    with tempfile.TemporaryDirectory(prefix="refinery-hf-") as tmp:
        local_file = os.path.join(tmp, "split.parquet")
        ds.to_parquet(local_file)
        with open(local_file, "rb") as f:
            storage.atomic_write_bytes(target, f.read())
    return target
