"""Deterministic training loader: fixed-length sequences from a mixture's shards, exact resume.

``loader, plan = build_loader(cfg, rank, world_size, split)``; ``inputs, targets = loader.next()``
gives this rank's ``(batch_size, seq_len)`` int64 arrays (targets = inputs shifted by one).
One ``refinery prep`` output needs no mixture file: ``loader, plan = prep_output_loader(output,
seq_len=..., batch_size=...)`` reads its shards as the one source.

How the stream is defined (numpy + stdlib only; no torch, no Beam):

- **Sources** are the mixture's sources; source ``s`` reads the shards
  ``{data_root}/{s}/{split}/manifest.json`` lists (exactly those: never a listing of the folder)
  in path order as one token stream (memory-mapped), cut into sequences of ``seq_len + 1``
  tokens: sequence ``i`` is tokens ``[i (L+1), (i+1)(L+1))``; ``n_s`` sequences fit.
- **Weights** are the mixture's shares as fixed-point integers summing to 1,000,000
  (:func:`refinery.transforms.loader.mixture.fixed_point_weights`).
- **Epoch quotas**: the epoch has ``E`` sequences, the largest number whose largest-remainder
  split by the weights, ``q_s``, fits every source (``q_s <= n_s``). Exact integers.
- **Order**: smooth weighted round robin over the quotas (add ``q_s`` to each source's
  counter, pick the largest, ties to the earlier source, subtract ``E``) gives every source
  exactly ``q_s`` picks per epoch, evenly spread. The ``j``-th pick of source ``s`` in epoch
  ``e`` is its sequence ``perm_{s,e}(j)``, a keyed permutation of ``range(n_s)`` (identity
  with ``shuffle=False``), so each epoch sees a fresh subset/order.
- **Ranks**: every rank walks the same global stream; call ``t`` covers global sequences
  ``[t B W, (t+1) B W)`` and rank ``r`` takes ``[t B W + r B, t B W + (r+1) B)``. The union of
  all ranks' sequences is the same global prefix whatever the world size.
- **Resume**: :meth:`DeterministicLoader.state_dict` holds the global position and the round
  robin's counters; :meth:`load_state_dict` continues at the exact next sequence, and refuses
  (:class:`LoaderStateError`) a state whose plan hash differs: the hash covers every shard
  file (relative path, size, and the manifest's sha256 when there is one), the weights,
  ``seq_len``, ``seed`` and ``shuffle``.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from refinery.transforms.formats import shards
from refinery.transforms.formats.failed_run import refuse_failed
from refinery.transforms.io import storage
from refinery.transforms.loader.mixture import (
    WEIGHT_SCALE,
    fixed_point_weights,
    largest_remainder,
    load_mixture_file,
    select_mixture,
    source_fractions,
    split_dir,
)

STATE_VERSION = 1


class LoaderStateError(ValueError):
    """A loader state that does not belong to this loader's plan."""


class ShortEpochWarning(UserWarning):
    """An epoch shorter than one global batch: a batch then wraps into the next epoch."""


@dataclass(frozen=True)
class LoaderConfig:
    """What :func:`build_loader` needs; any object or dict with these names works too."""

    mixture_config: str             # the mixture TOML
    data_root: str | None = None    # default: the file's data_root
    stage: str = "pretrain"
    mixture: str | None = None
    seq_len: int = 4096
    batch_size: int = 1             # sequences per rank per next()
    seed: int = 0
    shuffle: bool = True


@dataclass(frozen=True)
class SourceShards:
    id: str
    weight: int                     # fixed-point, out of WEIGHT_SCALE
    paths: tuple[str, ...]          # .npy files in stream order
    tokens: tuple[int, ...]         # tokens per file
    files: tuple[dict[str, Any], ...]  # what enters the plan hash: relpath, bytes, sha256 (if known)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


@dataclass(frozen=True)
class LoaderPlan:
    split: str
    seq_len: int
    seed: int
    shuffle: bool
    sources: tuple[SourceShards, ...]
    sequences: tuple[int, ...]      # n_s: sequences available per source
    quotas: tuple[int, ...]         # q_s: sequences per epoch per source
    epoch_sequences: int            # E = sum(quotas)
    plan_hash: str

    def describe(self) -> str:
        lines = [f"loader plan {self.plan_hash[:16]} split {self.split}: {self.epoch_sequences:,} sequences of "
                 f"{self.seq_len} per epoch"]
        for s, n, q in zip(self.sources, self.sequences, self.quotas):
            lines.append(f"  {s.id:24} weight {s.weight / WEIGHT_SCALE:.4f}  {len(s.paths)} shard(s) "
                         f"{s.total_tokens:,} tokens  {q:,} of {n:,} sequences per epoch")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------

def epoch_quotas(weights: list[int], available: list[int]) -> list[int]:
    """Largest-remainder quotas of the largest epoch every source can fill (``q_s <= n_s``)."""
    total_w = sum(weights)
    if total_w <= 0:
        raise ValueError("every weight is zero")
    epoch = min(n * total_w // w for w, n in zip(weights, available) if w > 0)
    while epoch > 0:
        q = largest_remainder(weights, epoch)
        if all(qi <= n for qi, n in zip(q, available)):
            return q
        epoch -= 1
    return [0] * len(weights)


def swrr_step(current: list[int], quotas: list[int], total: int) -> int:
    """One smooth-weighted-round-robin pick; updates ``current`` in place, returns the source."""
    best = -1
    for i, q in enumerate(quotas):
        current[i] += q
        if q > 0 and (best < 0 or current[i] > current[best]):
            best = i
    current[best] -= total
    return best


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a fixed 64-bit mixing function."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def permutation_key(seed: int, source_id: str, epoch: int) -> int:
    h = hashlib.sha256(f"{seed}:{source_id}:{epoch}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def permute(j: int, n: int, key: int, rounds: int = 4) -> int:
    """A keyed bijection of ``range(n)``: a balanced Feistel network on the next even power of
    two, cycle-walking until the value lands below ``n``. O(1) memory, deterministic."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = j
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix64(right ^ key ^ (r * 0x9E3779B97F4A7C15)) & mask)
        x = (left << half) | right
        if x < n:
            return x


MANIFEST = "manifest.json"
SHOWN = 3  # manifests named below a folder without one


def no_manifest_message(root: str) -> str:
    """Why ``root`` is no prep output to read: it has no manifest.json, and the manifests of
    other runs below it (the first few, bounded search) are named, to give one of them."""
    below = storage.folders_holding(root, (MANIFEST,), limit=SHOWN + 1)
    named = ", ".join(storage.join(b, MANIFEST) for b in below[:SHOWN]) + (" and more" if len(below) > SHOWN else "")
    return (f"{root}: no manifest.json here: not a finished refinery prep output"
            + (f"; the folder holds other runs' outputs ({named}): give one of them, each is read alone"
               if below else f" (`refinery status {root}` tells what is missing)"))


@dataclass(frozen=True)
class ListedShard:
    """A shard a manifest lists, as checked: its ``.npy`` path, tokens, bytes and sha256 (None
    when the manifest records none)."""

    path: str
    tokens: int
    bytes: int
    sha256: str | None


def manifest_shards(root: str) -> tuple[list[ListedShard], dict[str, Any]]:
    """(the ``.npy`` files ``root/manifest.json`` lists, in path order; the manifest): exactly
    those, never a listing of the folder. Each is checked as the manifest says: present, its
    NPY header's token count the manifest's ``num_tokens``, its size what that header implies
    (a shard cut short or rewritten is refused, naming it). A failed run (its ``FAILED.json``)
    is refused: :class:`~refinery.transforms.formats.failed_run.FailedRunError`."""
    refuse_failed(root)
    path = storage.join(root, MANIFEST)
    try:
        manifest = storage.read_json(path)
    except FileNotFoundError:
        raise FileNotFoundError(no_manifest_message(root)) from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    hint = f"`refinery verify {root}` names every problem"
    found = []
    for entry in manifest.get("shards", []) if isinstance(manifest, dict) else []:
        try:
            npy = storage.join(root, storage.safe_relpath(entry["path"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: a shard entry without a usable path ({e}); {hint}") from None
        size = storage.file_size(npy)
        if size is None:
            raise FileNotFoundError(f"{npy}: listed in {path}, missing; {hint}")
        tokens, expected = shards.npy_extent(npy)
        if tokens != entry.get("num_tokens") or size != expected:
            what = (f"{tokens:,} tokens, not the {entry.get('num_tokens')} {path} lists" if size == expected else
                    f"{size:,} bytes, not the {expected:,} its {tokens:,} tokens take")
            raise ValueError(f"{npy}: {what} (a shard cut short or rewritten since); {hint}")
        found.append(ListedShard(npy, tokens, size, entry.get("sha256")))
    return sorted(found, key=lambda f: f.path), manifest


def _tokenizer_of(m: dict[str, Any]) -> tuple[object, object, object] | None:
    """What a manifest says about its tokenizer (name, vocab sha256, EOS id), None without one."""
    return (m.get("tokenizer"), m.get("vocab_sha256"), m.get("eos_token_id")) if "tokenizer" in m else None


def build_plan(data_root: str, source_ids: list[str], weights: list[int], split: str, seq_len: int,
               seed: int = 0, shuffle: bool = True) -> LoaderPlan:
    """The loader's plan: shards per source, sequences, epoch quotas and the plan hash. Source
    ``s`` reads ``{data_root}/{s}/{split}`` (``refinery prep-mixture``'s layout)."""
    roots = [(sid, w, split_dir(data_root, sid, split)) for sid, w in zip(source_ids, weights)]
    return plan_of_roots(data_root, roots, split, seq_len, seed, shuffle,
                         missing="run `refinery prep-mixture` first")


def plan_of_roots(data_root: str, roots: list[tuple[str, int, str]], split: str, seq_len: int, seed: int = 0,
                  shuffle: bool = True, missing: str = "") -> LoaderPlan:
    """:func:`build_plan` of sources given as ``(id, weight, folder)``: the shards each folder's
    manifest.json lists (:func:`manifest_shards`; a folder without one is refused) are one
    source's stream; paths in the plan hash are relative to ``data_root``. ``missing``: what
    to do about a folder without shards (said in the error)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    sources = []
    tokenizers: dict[tuple[object, object, object], str] = {}  # tokenizer -> the first source prepared with it
    for sid, w, root in roots:
        if w == 0:
            continue
        try:
            paths, manifest = manifest_shards(root)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"source {sid!r}: no shards for split {split!r}: {e}"
                                    + (f" ({missing})" if missing else "")) from None
        if not paths:
            raise ValueError(f"source {sid!r}: {storage.join(root, MANIFEST)} lists no shards for split {split!r}")
        if (tok := _tokenizer_of(manifest)) is not None:
            tokenizers.setdefault(tok, sid)
            if len(tokenizers) > 1:
                (a, first), (b, _) = list(tokenizers.items())[:2]
                raise ValueError(f"split {split!r}: sources were tokenized differently: {first!r} with {a[0]} "
                                 f"(EOS {a[2]}), {sid!r} with {b[0]} (EOS {b[2]}); one stream needs one tokenizer")
        files = tuple({"path": f.path[len(data_root.rstrip('/')) + 1:], "bytes": f.bytes, "sha256": f.sha256}
                      for f in paths)
        sources.append(SourceShards(sid, w, tuple(f.path for f in paths), tuple(f.tokens for f in paths), files))
    available = [s.total_tokens // (seq_len + 1) for s in sources]
    quotas = epoch_quotas([s.weight for s in sources], available)
    if sum(quotas) == 0:
        short = [s.id for s, n in zip(sources, available) if n == 0]
        raise ValueError(f"split {split!r}: no full epoch fits; source(s) {short or [s.id for s in sources]} hold "
                         f"fewer than one sequence of {seq_len + 1} tokens per weight share")
    plan_hash = hashlib.sha256(json.dumps({
        "version": STATE_VERSION, "split": split, "seq_len": seq_len, "seed": seed, "shuffle": shuffle,
        "sources": [{"id": s.id, "weight": s.weight, "files": list(s.files)} for s in sources],
    }, sort_keys=True).encode()).hexdigest()
    return LoaderPlan(split, seq_len, seed, shuffle, tuple(sources), tuple(available), tuple(quotas),
                      sum(quotas), plan_hash)


# ---------------------------------------------------------------------------------------
# The loader
# ---------------------------------------------------------------------------------------

class _SourceStream:
    """A source's shards as one memory-mapped token stream."""

    def __init__(self, src: SourceShards):
        self.paths = src.paths
        self.offsets = np.concatenate(([0], np.cumsum(src.tokens, dtype=np.int64)))
        self._maps: dict[int, shards.TokenArray] = {}

    def _tokens(self, f: int) -> shards.TokenArray:
        if f not in self._maps:
            self._maps[f] = shards.open_tokens(self.paths[f])
        return self._maps[f]

    def read(self, start: int, end: int) -> np.ndarray:
        out = np.empty(end - start, dtype=np.int64)
        f = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < end:
            lo = pos - int(self.offsets[f])
            hi = min(end, int(self.offsets[f + 1])) - int(self.offsets[f])
            if hi > lo:
                out[pos - start:pos - start + hi - lo] = self._tokens(f)[lo:hi]
            pos += hi - lo
            f += 1
        return out


class DeterministicLoader:
    """Yields this rank's ``(inputs, targets)`` batches of the plan's global stream (see module doc)."""

    def __init__(self, plan: LoaderPlan, rank: int = 0, world_size: int = 1, batch_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.plan = plan
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        if (step := batch_size * world_size) > plan.epoch_sequences:
            warnings.warn(f"an epoch of split {plan.split!r} holds {plan.epoch_sequences:,} sequence(s) of "
                          f"{plan.seq_len + 1} tokens, fewer than one global batch ({batch_size} x {world_size} "
                          f"rank(s) = {step:,}): each batch repeats sequences of the epoch before it",
                          ShortEpochWarning, stacklevel=2)
        self._streams = [_SourceStream(s) for s in plan.sources]
        self._reset(position=0, epoch=0)

    def _reset(self, position: int, epoch: int) -> None:
        self.position = position      # global sequences consumed, over all epochs
        self.epoch = epoch
        self.in_epoch = 0             # global sequences consumed in this epoch
        self.current = [0] * len(self.plan.sources)
        self.taken = [0] * len(self.plan.sources)

    def _advance(self) -> tuple[int, int]:
        """The next global sequence: (source index, sequence index within the source)."""
        plan = self.plan
        if self.in_epoch == plan.epoch_sequences:
            self.epoch += 1
            self.in_epoch = 0
            self.current = [0] * len(plan.sources)
            self.taken = [0] * len(plan.sources)
        s = swrr_step(self.current, list(plan.quotas), plan.epoch_sequences)
        j = self.taken[s]
        self.taken[s] += 1
        self.in_epoch += 1
        self.position += 1
        n = plan.sequences[s]
        seq = permute(j, n, permutation_key(plan.seed, plan.sources[s].id, self.epoch)) if plan.shuffle else j
        return s, seq

    def sequence(self, source: int, seq: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of a source's sequence ``seq``."""
        width = self.plan.seq_len + 1
        return self._streams[source].read(seq * width, (seq + 1) * width)

    def next_ids(self) -> list[tuple[int, int]]:
        """Advance one step; (source, sequence) of this rank's batch (others' are skipped)."""
        mine = []
        lo = self.rank * self.batch_size
        for k in range(self.batch_size * self.world_size):
            pick = self._advance()
            if lo <= k < lo + self.batch_size:
                mine.append(pick)
        return mine

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's next batch: ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64."""
        rows = np.stack([self.sequence(s, q) for s, q in self.next_ids()])
        return rows[:, :-1], rows[:, 1:]

    __next__ = next

    def __iter__(self) -> DeterministicLoader:
        return self

    def state_dict(self) -> dict[str, Any]:
        """JSON-able; the same on every rank (all ranks walk one global stream)."""
        return {"version": STATE_VERSION, "plan_hash": self.plan.plan_hash, "position": self.position,
                "epoch": self.epoch, "in_epoch": self.in_epoch, "swrr_current": list(self.current),
                "taken": list(self.taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the exact next sequence of ``state``; refuse a state of another plan."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"not a loader state of version {STATE_VERSION}: "
                                   f"{state.get('version') if isinstance(state, dict) else type(state).__name__}")
        if state.get("plan_hash") != self.plan.plan_hash:
            raise LoaderStateError(
                f"loader state belongs to plan {str(state.get('plan_hash'))[:16]}, this loader's plan is "
                f"{self.plan.plan_hash[:16]} (split {self.plan.split}): the shard files, the mixture weights, "
                f"seq_len, seed or shuffle changed since the checkpoint. Resume with the data and config it was "
                f"saved with, or start the loader fresh.")
        n = len(self.plan.sources)
        cur, taken = list(state["swrr_current"]), list(state["taken"])
        if len(cur) != n or len(taken) != n or not 0 <= state["in_epoch"] <= self.plan.epoch_sequences:
            raise LoaderStateError("loader state is inconsistent with its plan (counters of the wrong size)")
        self.position, self.epoch, self.in_epoch = int(state["position"]), int(state["epoch"]), int(state["in_epoch"])
        self.current, self.taken = [int(c) for c in cur], [int(t) for t in taken]


def _get(cfg: object, name: str, default: object = None) -> Any:  # a setting of a dict or any object
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def build_loader(cfg: object, rank: int = 0, world_size: int = 1,
                 split: str = "train") -> tuple[DeterministicLoader, LoaderPlan]:
    """(loader, plan) for ``split`` of the mixture ``cfg`` names (a :class:`LoaderConfig`, a dict
    or any object with ``mixture_config``, ``data_root``, ``stage``, ``mixture``, ``seq_len``,
    ``batch_size``, ``seed``, ``shuffle``)."""
    path = _get(cfg, "mixture_config")
    if not path:
        raise ValueError("build_loader: cfg names no mixture_config (the mixture TOML)")
    mf = load_mixture_file(os.fspath(path))
    mixture = select_mixture(mf, _get(cfg, "stage", "pretrain"), _get(cfg, "mixture"))
    data_root = _get(cfg, "data_root") or mf.data_root
    if not data_root:
        raise ValueError(f"build_loader: no data_root in cfg or in {path}")
    weights = fixed_point_weights(source_fractions(mixture))
    plan = build_plan(os.fspath(data_root), [s.id for s in mixture.sources], weights, split,
                      int(_get(cfg, "seq_len", 4096)), int(_get(cfg, "seed", 0)), bool(_get(cfg, "shuffle", True)))
    return DeterministicLoader(plan, rank, world_size, int(_get(cfg, "batch_size", 1))), plan


def prep_output_loader(output: str, *, seq_len: int = 4096, batch_size: int = 1, seed: int = 0,
                       shuffle: bool = True, rank: int = 0,
                       world_size: int = 1) -> tuple[DeterministicLoader, LoaderPlan]:
    """(loader, plan) over ONE ``refinery prep`` output (the folder holding its manifest.json and
    ``shard_*/``; the ``manifest.json`` path itself is accepted too): the shards its manifest
    lists are the only source (never other files under the folder), in path order, checked
    against the manifest's sha256s in the plan hash; no mixture file. The split is named
    ``train``. A folder without a manifest at its root is refused, naming the manifests below it;
    so is a failed run, naming its failure and corrupt input files."""
    root = os.fspath(output)
    if root.endswith("manifest.json"):
        root = storage.dirname(root)
    root = root.rstrip("/")
    refuse_failed(root)
    if not storage.exists(storage.join(root, MANIFEST)):
        raise FileNotFoundError(no_manifest_message(root))
    name = storage.basename(root) or "output"
    plan = plan_of_roots(storage.dirname(root), [(name, WEIGHT_SCALE, root)], "train", seq_len, seed, shuffle)
    return DeterministicLoader(plan, rank, world_size, batch_size), plan
