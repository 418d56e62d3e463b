"""Hugging Face datasets as prep inputs: a dataset name -> its parquet files at a pinned revision.

``resolve_hf_parquet(name, subset, split, revision)`` asks the hub once for the revision's
commit sha and lists the parquet files of that subset and split through huggingface_hub's
``hf://`` filesystem. The sha goes into the plan, so a rerun reads the same files even if
the dataset moves on; pass ``--hf-revision SHA`` to pin it without asking the hub.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HfSource:
    name: str
    subset: str | None
    split: str
    revision: str  # commit sha
    files: tuple[str, ...]  # hf:// paths

    def describe(self) -> dict:
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
                       fs=None, api=None) -> HfSource:
    """The parquet files of ``name``/``subset``/``split``; raises ValueError naming what was tried."""
    if fs is None or (api is None and revision is None):
        from huggingface_hub import HfApi, HfFileSystem
        fs = fs or HfFileSystem()
        api = api or HfApi()
    sha = revision if revision and len(revision) == 40 else api.dataset_info(name, revision=revision).sha
    tried = []
    for ref in (sha, "refs%2Fconvert%2Fparquet"):
        root = f"datasets/{name}@{ref}"
        for pat in candidate_globs(subset, split):
            tried.append(f"{root}/{pat}")
            found = sorted(fs.glob(f"{root}/{pat}"))
            if found:
                return HfSource(name, subset, split, sha, tuple(f"hf://{p}" for p in found))
    raise ValueError(f"no parquet files for {name} subset={subset} split={split} at {sha}; tried: "
                     + ", ".join(tried))
