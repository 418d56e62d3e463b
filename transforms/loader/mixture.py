"""Mixture TOML: sources, their weights, token budgets per flow, and the per-source/split plan.

A mixture file (see ``examples/mix.toml``)::

    data_root = "/data"                 # optional; --data-root overrides it
    [flows.proxy]                       # optional: extra flows or new targets for known ones
    total_tokens_b = 0.5
    [stages]                            # optional: which mixture a --stage uses
    pretrain = "pretrain_mix"

    [mixtures.pretrain_mix]
    total_tokens_b = 100.0              # the full mixture's size (the target when no --flow)
    sample_temperature = 1.0            # weights ** (1 / T), then normalized
    [[mixtures.pretrain_mix.sources]]
    id = "fineweb"
    percent = 80.0                      # weight (all sources give percent, summing to 100) ...
    tokens_b = 80.0                     # ... or tokens_b (then weight = tokens_b); also a cap
    hf_dataset = "HuggingFaceFW/fineweb-edu"   # a Hugging Face dataset (its parquet files) ...
    hf_subset = "sample-10BT"
    hf_split = "train"                  # default "train"
    hf_valid_split = "train[:1%]"       # percent slices select that share of the split's files
    text_field = "text"                 # default "text" (a chat message list is flattened) ...
    # ... or text_template = "{question}\\n\\n{answer}"  (TOML reads \\n as a newline; see core.text)
    # ... or local / gs:// paths: path = "corpus/" (train), valid_path = "held_out/"

Budgets: the flow's target (dev 100M, research 1B, ablation 6B, or ``[flows.X]``; without
a flow, the mixture's ``total_tokens_b``) is capped by ``--max-tokens``, then split over the
sources by their fixed-point weights with largest-remainder rounding, so the budgets are
integers summing exactly to the target; a source's ``tokens_b`` caps its own budget.
Relative paths in the file are relative to the file's folder.

Everything here is pure (no Beam, no network): tests call it directly.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

from refinery.transforms.formats.shards import NAME_RULE
from refinery.transforms.io import storage
from refinery.transforms.io.text import TextSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

FLOW_TARGETS = {"dev": 100_000_000, "research": 1_000_000_000, "ablation": 6_000_000_000}
WEIGHT_SCALE = 1_000_000  # fixed-point weights: integers summing to this
SOURCE_KEYS = {"id", "tokens_b", "percent", "hf_dataset", "hf_subset", "hf_split", "hf_valid_split",
               "hf_revision", "text_field", "text_template", "id_field", "path", "valid_path"}
_T = TypeVar("_T")
_ID = NAME_RULE  # a source id names folders and shards: the dataset-name rule
_SPLIT = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(?:\[(?P<lo>\d+(?:\.\d+)?%)?:(?P<hi>\d+(?:\.\d+)?%)?\])?$")


class MixtureError(ValueError):
    """A mixture file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class SplitSlice:
    """A Hugging Face split with an optional percent slice: ``train[:1%]`` -> (train, 0, 1)."""

    name: str
    lo_percent: float = 0.0
    hi_percent: float = 100.0

    @property
    def sliced(self) -> bool:
        return (self.lo_percent, self.hi_percent) != (0.0, 100.0)

    def select(self, files: Sequence[_T]) -> list[_T]:
        """The share of ``files`` (sorted) the slice covers: at least one file if any exist."""
        if not self.sliced or not files:
            return list(files)
        n = len(files)
        lo = math.floor(self.lo_percent * n / 100)
        hi = max(math.ceil(self.hi_percent * n / 100), lo + 1)
        return list(files[lo:min(hi, n)])

    def __str__(self) -> str:
        if not self.sliced:
            return self.name

        def fmt(v: float) -> str:
            return f"{v:g}%"

        return f"{self.name}[{fmt(self.lo_percent) if self.lo_percent else ''}:" \
               f"{fmt(self.hi_percent) if self.hi_percent != 100 else ''}]"


def parse_split(spec: str, where: str) -> SplitSlice:
    """``train``, ``train[:1%]``, ``train[99%:]``, ``train[10%:20%]``; row-count slices are refused."""
    m = _SPLIT.match(spec.strip())
    if not m:
        raise MixtureError(f"{where}: split {spec!r} is not NAME or NAME[a%:b%] (row-count slices are not supported)")
    lo = float(m.group("lo")[:-1]) if m.group("lo") else 0.0
    hi = float(m.group("hi")[:-1]) if m.group("hi") else 100.0
    if not 0 <= lo < hi <= 100:
        raise MixtureError(f"{where}: split {spec!r} has an empty or out-of-range percent slice")
    return SplitSlice(m.group("name"), lo, hi)


@dataclass(frozen=True)
class Source:
    """One ``[[mixtures.NAME.sources]]`` entry. Either ``hf_dataset`` or ``paths`` (train)."""

    id: str
    tokens_b: float | None = None
    percent: float | None = None
    hf_dataset: str | None = None
    hf_subset: str | None = None
    hf_revision: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    text_template: str | None = None  # set: the text is this template over the rows' fields (text_field unused)
    hf_splits: dict[str, SplitSlice] = field(default_factory=dict)    # split -> SplitSlice (hf sources)
    path_splits: dict[str, tuple[str, ...]] = field(default_factory=dict)  # split -> tuple of paths (path sources)

    @property
    def is_hf(self) -> bool:
        return self.hf_dataset is not None

    def has_split(self, split: str) -> bool:
        return split in (self.hf_splits if self.is_hf else self.path_splits)

    def describe_split(self, split: str) -> str:
        if self.is_hf:
            sub = f" ({self.hf_subset})" if self.hf_subset else ""
            return f"hf:{self.hf_dataset}{sub} split {self.hf_splits[split]}"
        return ", ".join(self.path_splits[split])


@dataclass(frozen=True)
class Mixture:
    name: str
    sources: tuple[Source, ...]
    total_tokens_b: float | None = None
    sample_temperature: float = 1.0


@dataclass(frozen=True)
class MixtureFile:
    path: str
    mixtures: dict[str, Mixture]
    data_root: str | None = None
    flows: dict[str, int] = field(default_factory=dict)   # flow -> tokens
    stages: dict[str, str] = field(default_factory=dict)  # stage -> mixture name

    def flow_targets(self) -> dict[str, int]:
        return {**FLOW_TARGETS, **self.flows}


def _resolve_path(p: str, base_dir: str) -> str:
    if "://" in p or os.path.isabs(p):
        return p
    return os.path.normpath(os.path.join(base_dir, p))


def _number(value: object, where: str, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MixtureError(f"{where}: {key} must be a number, got {value!r}")
    if value < 0:
        raise MixtureError(f"{where}: {key} must not be negative, got {value}")
    return float(value)


def _parse_source(raw: dict[str, Any], where: str, base_dir: str) -> Source:
    if not isinstance(raw, dict):
        raise MixtureError(f"{where}: a source must be a table")
    sid = raw.get("id")
    if not isinstance(sid, str) or not _ID.match(sid):
        raise MixtureError(f"{where}: id must be a name of letters, digits, '_', '-', '.', got {sid!r}")
    where = f"{where} (id {sid!r})"
    unknown = sorted(k for k in raw if k not in SOURCE_KEYS and not re.fullmatch(r"(hf_\w+_split|\w+_path)", k))
    if unknown:
        raise MixtureError(f"{where}: unknown key(s) {unknown} (known: {sorted(SOURCE_KEYS)}, "
                           f"hf_SPLIT_split, SPLIT_path)")
    has_hf, has_path = raw.get("hf_dataset") is not None, raw.get("path") is not None
    if has_hf == has_path:
        raise MixtureError(f"{where}: give exactly one of hf_dataset or path")
    template = raw.get("text_template")
    if template is not None:
        if "text_field" in raw:
            raise MixtureError(f"{where}: give text_field or text_template, not both")
        if not isinstance(template, str):
            raise MixtureError(f"{where}: text_template must be a string, got {template!r}")
        try:
            TextSpec(template=template)
        except ValueError as e:
            raise MixtureError(f"{where}: text_template: {e}") from None
    hf_splits, path_splits = {}, {}
    if has_hf:
        hf_splits["train"] = parse_split(str(raw.get("hf_split", "train")), where)
        for k, v in raw.items():
            m = re.fullmatch(r"hf_(\w+)_split", k)
            if m:
                hf_splits[m.group(1)] = parse_split(str(v), where)
    else:
        for k, v in raw.items():
            if k == "path" or k.endswith("_path"):
                split = "train" if k == "path" else k[: -len("_path")]
                paths = [v] if isinstance(v, str) else v
                if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
                    raise MixtureError(f"{where}: {k} must be a path or a list of paths")
                path_splits[split] = tuple(_resolve_path(p, base_dir) for p in paths)
    return Source(
        id=sid, tokens_b=_number(raw.get("tokens_b"), where, "tokens_b"),
        percent=_number(raw.get("percent"), where, "percent"),
        hf_dataset=raw.get("hf_dataset"), hf_subset=raw.get("hf_subset"), hf_revision=raw.get("hf_revision"),
        text_field=str(raw.get("text_field", "text")), id_field=str(raw.get("id_field", "id")),
        text_template=template, hf_splits=hf_splits, path_splits=path_splits)


def parse_mixture_file(data: dict[str, Any], path: str) -> MixtureFile:
    """A parsed TOML document -> :class:`MixtureFile`; raises MixtureError naming the entry."""
    base_dir = os.path.dirname(os.path.abspath(path)) if "://" not in path else os.path.dirname(path)
    raw_mixtures = data.get("mixtures")
    if not isinstance(raw_mixtures, dict) or not raw_mixtures:
        raise MixtureError(f"{path}: no [mixtures.NAME] table")
    mixtures = {}
    for name, raw in raw_mixtures.items():
        where = f"{path}: [mixtures.{name}]"
        if not isinstance(raw, dict):
            raise MixtureError(f"{where}: must be a table")
        raw_sources = raw.get("sources")
        if not isinstance(raw_sources, list) or not raw_sources:
            raise MixtureError(f"{where}: no [[mixtures.{name}.sources]] entries")
        sources = tuple(_parse_source(s, f"{where} source #{i + 1}", base_dir) for i, s in enumerate(raw_sources))
        ids = [s.id for s in sources]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise MixtureError(f"{where}: duplicate source id(s) {dup}")
        temp = _number(raw.get("sample_temperature", 1.0), where, "sample_temperature")
        if not temp:
            raise MixtureError(f"{where}: sample_temperature must be > 0")
        mixtures[name] = Mixture(name, sources, _number(raw.get("total_tokens_b"), where, "total_tokens_b"), temp)
        try:
            source_fractions(mixtures[name])  # validate the weights now, naming the file
        except MixtureError as e:
            raise MixtureError(f"{path}: {e}") from None
    flows = {}
    for name, raw in (data.get("flows") or {}).items():
        tb = _number((raw or {}).get("total_tokens_b") if isinstance(raw, dict) else None, f"{path}: [flows.{name}]",
                     "total_tokens_b")
        if tb is None:
            raise MixtureError(f"{path}: [flows.{name}] needs total_tokens_b")
        flows[name] = int(round(tb * 1e9))
    stages: dict[str, str] = {}
    for stage, mix in (data.get("stages") or {}).items():
        name = mix.get("mixture") if isinstance(mix, dict) else mix
        if not isinstance(name, str) or name not in mixtures:
            raise MixtureError(f"{path}: [stages] {stage} names mixture {name!r}, not defined "
                               f"(defined: {sorted(mixtures)})")
        stages[stage] = name
    root = data.get("data_root")
    if root is not None and not isinstance(root, str):
        raise MixtureError(f"{path}: data_root must be a string")
    return MixtureFile(path, mixtures, _resolve_path(root, base_dir) if root else None, flows, stages)


def load_mixture_file(path: str) -> MixtureFile:
    """Read and parse a mixture TOML (local or gs://)."""
    try:
        data = tomllib.loads(storage.read_bytes(path).decode("utf-8"))
    except FileNotFoundError:
        raise MixtureError(f"{path}: not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MixtureError(f"{path}: not valid TOML ({e})") from None
    return parse_mixture_file(data, path)


def select_mixture(mf: MixtureFile, stage: str | None = None, name: str | None = None) -> Mixture:
    """The mixture named ``name``; else the one ``[stages]`` maps ``stage`` to; else the only
    one; else one named ``stage`` or ``{stage}_*``, if exactly one matches."""
    if name is not None:
        if name not in mf.mixtures:
            raise MixtureError(f"{mf.path}: no mixture {name!r} (defined: {sorted(mf.mixtures)})")
        return mf.mixtures[name]
    if stage and stage in mf.stages:
        return mf.mixtures[mf.stages[stage]]
    if len(mf.mixtures) == 1:
        return next(iter(mf.mixtures.values()))
    matches = [m for n, m in mf.mixtures.items() if stage and (n == stage or n.startswith(stage + "_"))]
    if len(matches) == 1:
        return matches[0]
    raise MixtureError(f"{mf.path}: cannot tell which mixture stage {stage!r} uses among {sorted(mf.mixtures)}; "
                       f"add [stages] {stage or 'STAGE'} = \"NAME\" or pass --mixture NAME")


def flow_target(mf: MixtureFile, mixture: Mixture, flow: str | None) -> int:
    """Tokens the flow asks for; without a flow, the mixture's full size."""
    targets = mf.flow_targets()
    if flow is not None:
        if flow not in targets:
            raise MixtureError(f"{mf.path}: unknown flow {flow!r} (known: {sorted(targets)}; add [flows.{flow}])")
        return targets[flow]
    if mixture.total_tokens_b is not None:
        return int(round(mixture.total_tokens_b * 1e9))
    if all(s.tokens_b is not None for s in mixture.sources):
        return int(round(sum(s.tokens_b for s in mixture.sources if s.tokens_b is not None) * 1e9))
    raise MixtureError(f"{mf.path}: mixture {mixture.name!r} has no total_tokens_b; pass --flow")


def source_fractions(mixture: Mixture) -> list[float]:
    """Each source's share (summing to 1): ``percent`` if every source has one (they must sum
    to 100), else ``tokens_b``; then ``** (1 / sample_temperature)`` and normalized."""
    where = f"mixture {mixture.name!r}"
    if all(s.percent is not None for s in mixture.sources):
        base = [s.percent for s in mixture.sources if s.percent is not None]  # every one
        if abs(sum(base) - 100.0) > 1e-6:
            raise MixtureError(f"{where}: source percents sum to {sum(base):g}, not 100")
    elif all(s.tokens_b is not None for s in mixture.sources):
        base = [s.tokens_b for s in mixture.sources if s.tokens_b is not None]  # every one
    else:
        missing = [s.id for s in mixture.sources if s.percent is None and s.tokens_b is None]
        partial = [s.id for s in mixture.sources if s.percent is None]
        raise MixtureError(f"{where}: every source needs percent (or every source tokens_b); "
                           f"missing on {missing or partial}")
    powered = [b ** (1.0 / mixture.sample_temperature) if b > 0 else 0.0 for b in base]
    total = sum(powered)
    if total <= 0:
        raise MixtureError(f"{where}: all source weights are zero")
    return [p / total for p in powered]


def largest_remainder(weights: list[int], total: int) -> list[int]:
    """Integers proportional to ``weights`` summing exactly to ``total`` (Hamilton's method).

    Exact integer arithmetic; ties in the remainder go to the earlier entry.
    """
    wsum = sum(weights)
    if wsum <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    floors = [total * w // wsum for w in weights]
    rems = [total * w % wsum for w in weights]
    short = total - sum(floors)
    for i in sorted(range(len(weights)), key=lambda i: (-rems[i], i))[:short]:
        floors[i] += 1
    return floors


def fixed_point_weights(fractions: list[float], scale: int = WEIGHT_SCALE) -> list[int]:
    """Float shares -> integers summing to ``scale`` (largest remainder on the rounded-down parts)."""
    micro = [int(round(f * scale * 1000)) for f in fractions]  # 1e-9 resolution before the final split
    return largest_remainder(micro, scale)


def source_budgets(mixture: Mixture, target: int, max_tokens: int | None = None) -> dict[str, int]:
    """Tokens per source: min(target, max_tokens) split by the fixed-point weights, each capped
    by the source's ``tokens_b``."""
    if max_tokens is not None:
        target = min(target, max_tokens)
    shares = largest_remainder(fixed_point_weights(source_fractions(mixture)), target)
    out = {}
    for s, share in zip(mixture.sources, shares):
        cap = int(round(s.tokens_b * 1e9)) if s.tokens_b is not None else None
        out[s.id] = share if cap is None else min(share, cap)
    return out


def split_budget(train_budget: int, split: str, valid_percent: float) -> int:
    """The ``train`` split gets the source's budget; any other split ``valid_percent`` of it (>= 1)."""
    if split == "train":
        return train_budget
    return max(1, int(train_budget * valid_percent / 100)) if train_budget else 0


@dataclass(frozen=True)
class SplitPlan:
    """One resumable prep run: a source's split into ``{data_root}/{source_id}/{split}``."""

    source: Source
    split: str
    output: str
    budget: int

    @property
    def label(self) -> str:
        return f"{self.source.id}/{self.split}"


def split_dir(data_root: str, source_id: str, split: str) -> str:
    """``{data_root}/{source_id}/{split}`` (the seed's layout convention)."""
    return data_root.rstrip("/") + f"/{source_id}/{split}"


def plan_mixture(mixture: Mixture, data_root: str, splits: list[str], target: int,
                 max_tokens: int | None = None, valid_percent: float = 1.0) -> tuple[list[SplitPlan], list[str]]:
    """(runs to do, notes on source/splits skipped because the source defines no such split)."""
    budgets = source_budgets(mixture, target, max_tokens)
    plans, skipped = [], []
    for s in mixture.sources:
        for split in splits:
            if not s.has_split(split):
                skipped.append(f"{s.id}/{split}: the source defines no {split} split "
                               f"({'hf_' + split + '_split' if s.is_hf else split + '_path'})")
                continue
            plans.append(SplitPlan(s, split, split_dir(data_root, s.id, split),
                                   split_budget(budgets[s.id], split, valid_percent)))
    return plans, skipped


def format_tokens(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)
