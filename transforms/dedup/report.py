"""dedup's report (``report.md``): what a reader checks first, rendered from the run's counts.

Pure functions of plain data (the report stage gathers it): the settings, the duplicate share
of each input, the largest clusters with their kept row and their least alike removed row
side by side, and the buckets skipped over the cap."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from refinery.transforms.dedup.minhash import candidate_probability, curve_midpoint

SHOWN_CHARS = 400  # characters of each text of a cluster's example


@dataclass
class InputShare:
    path: str
    rows: int
    documents: int
    removed: int

    @property
    def share(self) -> float:
        return self.removed / self.documents if self.documents else 0.0


@dataclass
class ClusterExample:
    cluster: int
    size: int
    exact: int
    min_jaccard: float
    kept: str          # path:row
    removed: str       # path:row of the least alike removed row
    kept_text: str
    removed_text: str


@dataclass
class ReportData:
    settings: list[tuple[str, str]]
    inputs: list[InputShare]
    clusters: int
    removed: int
    exact_removed: int
    examples: list[ClusterExample]
    skipped: dict[str, Any] = field(default_factory=dict)  # {buckets, documents, largest: [[band, size, path:row]]}
    verify: dict[str, int] = field(default_factory=dict)   # candidates, pairs, verified, below
    curve: tuple[int, int] | None = None                   # (bands, rows) in minhash mode


def _cell(text: str) -> str:
    """``text`` in one markdown table cell: cut to :data:`SHOWN_CHARS`, line breaks shown as
    ``<br>``, pipes and HTML escaped."""
    cut = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + " \u2026"
    safe = cut.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return safe.replace("\n", "<br>")


def _inputs(rows: Sequence[InputShare]) -> list[str]:
    out = ["| input | rows | documents | removed | share |", "|---|---:|---:|---:|---:|"]
    out += [f"| `{r.path}` | {r.rows:,} | {r.documents:,} | {r.removed:,} | {100 * r.share:.2f}% |" for r in rows]
    docs, removed = sum(r.documents for r in rows), sum(r.removed for r in rows)
    share = 100 * removed / docs if docs else 0.0
    out.append(f"| **all** | {sum(r.rows for r in rows):,} | {docs:,} | {removed:,} | {share:.2f}% |")
    return out


def _examples(examples: Sequence[ClusterExample]) -> list[str]:
    out: list[str] = []
    for e in examples:
        out += ["", f"### cluster {e.cluster}: {e.size:,} rows ({e.exact:,} removed with the kept text, lowest "
                    f"Jaccard to it {e.min_jaccard:.3f})", "",
                f"| kept: `{e.kept}` | removed: `{e.removed}` |", "|---|---|",
                f"| {_cell(e.kept_text)} | {_cell(e.removed_text)} |"]
    return out


def _skipped(skipped: dict[str, Any]) -> list[str]:
    if not skipped.get("buckets"):
        return ["No bucket was over the cap."]
    out = [f"**{skipped['buckets']:,} bucket(s) over the cap were skipped** ({skipped['documents']:,} documents "
           "in them; their pairs were not compared: raise --max-bucket to compare them):", "",
           "| band | texts | first row |", "|---:|---:|---|"]
    out += [f"| {band} | {size:,} | `{where}` |" for band, size, where in skipped.get("largest", [])]
    return out


def _curve(bands: int, rows: int) -> list[str]:
    points = [0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    probs = candidate_probability(np.array(points), bands, rows)
    return [f"MinHash: {bands} bands x {rows} rows; a pair of Jaccard s is a candidate with probability "
            f"1 - (1 - s^{rows})^{bands} (steepest near {curve_midpoint(bands, rows):.2f}):", "",
            "| Jaccard | " + " | ".join(f"{s:.2f}" for s in points) + " |",
            "|---|" + "---:|" * len(points),
            "| candidate | " + " | ".join(f"{p:.3f}" for p in probs.tolist()) + " |"]


def render_report(data: ReportData) -> str:
    """``report.md``."""
    docs = sum(r.documents for r in data.inputs)
    lines = ["# refinery dedup", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in data.settings]
    lines += ["", f"**{data.removed:,} of {docs:,} documents removed** as duplicates ({data.exact_removed:,} of them "
                  f"exact copies) in {data.clusters:,} cluster(s); each cluster keeps its first row in input order.",
              "", "## Duplicate share per input", "", *_inputs(data.inputs)]
    if data.curve is not None:
        lines += ["", "## Candidates", "", *_curve(*data.curve), ""]
        if data.verify:
            v = data.verify
            lines.append(f"Candidate pairs: {v['pairs']:,} distinct ({v['candidates']:,} found), {v['verified']:,} "
                         f"verified by the Jaccard of their shingle sets, {v['below']:,} below the threshold.")
        lines += ["", *_skipped(data.skipped)]
    lines += ["", f"## The largest clusters ({len(data.examples)})"]
    lines += _examples(data.examples) if data.examples else ["", "No duplicates."]
    return "\n".join(lines) + "\n"
