"""The contamination report as one self-contained HTML page (``stats/report.html``).

Pure rendering: typed dataclasses in, one ``str`` out (no Beam, no file IO, no network).
The reduce stage of ``refinery decon`` fills :class:`ContaminationReport` and writes the
page (UTF-8) beside ``report.md``.

The page, top to bottom:

- **Header**: the title and one sentence: how many eval datasets overlap the training data,
  or that none does, or that there was nothing to compare.
- **At a glance**: one card per eval dataset with its row counts; per n, the contaminated
  share as a horizontal SVG bar with the counts ("37 / 1,319 instances, 2.8%") beside
  HELM's binary, jaccard and token metrics (plain and weighted by 1/training count), in a
  table that scrolls inside its card and, on a narrow screen, stacks each n's cells under
  their labels (``data-label``); then links to the dataset's sections per n.
- **By n: the evidence**: per dataset, one section per configured n (plain sections, no
  script: each has an anchor ``evidence-<dataset>-n<n>``) with everything counted at that n:
  the contaminated instances and the training rows they overlap, the training files
  contributing most (instances and training rows at that n, top :data:`MAX_TOP_FILES`),
  the most frequent overlapping n-grams (instances and training rows, top
  :data:`MAX_TOP_NGRAMS`: boilerplate shows as such), and the most contaminated instances at
  that n as chosen by the caller: the instance text with its overlapping spans in ``<mark>``
  (clamped to the text, empty ones ignored, overlapping or adjacent ones merged), its id,
  row, longest match (the longest run of its tokens one training row's n-grams cover) and
  token overlap; then each training hit (path, row, shared n-grams) with its snippet
  highlighted the same way. A legend explains the highlight colour.
- **Settings**: the run's settings, the inputs with their fingerprints and the rows read on
  each side, so that a reader can reproduce the run.

Guarantees:

- Escaping: highlighting is computed on the raw text; each raw piece is then escaped on its
  own (``html.escape(quote=True)``). C0 control characters and lone surrogates become
  U+FFFD / ``?`` (one code point for one, so offsets still hold).
- Self-contained: inline CSS and SVG only, no ``<script>``, nothing fetched; the only links
  are in-page anchors.
- Deterministic: no timestamps, nothing depends on set or hash order; the same report gives
  the same bytes.
- Bounded: the page's UTF-8 size is at most ``max_bytes``. Texts show a window of at most
  :data:`MAX_TEXT_CHARS` characters around their spans (snippets :data:`MAX_SNIPPET_CHARS`),
  labels are cut at :data:`MAX_LABEL_CHARS`, lists are capped. If the page is still too
  large, examples are dropped from the end of each dataset's list at each n (round robin, so
  every dataset and n keeps its top ones) with a note saying how many were omitted; past that, the last
  dataset cards go (with a note); in the extreme the page is a short notice.
"""
from __future__ import annotations

import bisect
import html
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

MAX_TEXT_CHARS = 3000       # characters of an eval text shown around its spans
MAX_SNIPPET_CHARS = 1000    # characters of a training snippet shown
CONTEXT_CHARS = 200         # characters shown before the first span when the spans do not fit
WORD_SLACK = 30             # characters a cut text gives up at most to start and end on whole words
MAX_LABEL_CHARS = 300       # names, paths, ids, settings values
MAX_HITS = 2                # training hits shown per example
MAX_TOP_FILES = 10          # training files listed per dataset and n
MAX_TOP_NGRAMS = 15         # overlapping n-grams listed per dataset and n
MAX_EVAL_PATHS = 10         # eval paths listed per dataset
MAX_SETTINGS = 200          # settings rows
MAX_INPUTS_PER_SIDE = 50    # inputs listed per side ("eval", "train")
MAX_ROWS_READ = 50          # "rows read" entries
BAR_WIDTH = 240             # px, the full share bar
BAR_HEIGHT = 14
MIN_MAX_BYTES = 16_384      # the short notice page always fits in this
_SLACK_PER_GROUP = 64       # bytes: notes whose numbers grow once examples are placed, per dataset and n


# ---------------------------------------------------------------------------------------
# The input: plain typed records
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """``[start, end)`` character (code point) offsets into a text."""
    start: int
    end: int


@dataclass(frozen=True)
class TrainHit:
    """One training document that shares n-grams with the instance."""
    train_path: str
    train_row: int
    snippet: str                        # training text around the hit, cut by the caller
    snippet_spans: tuple[Span, ...]     # overlapping spans, offsets relative to `snippet`
    ngrams: int                         # distinct overlapping n-grams this training row shares
    cut_before: bool = False            # the training text goes on before `snippet`
    cut_after: bool = False             # ... and after it


@dataclass(frozen=True)
class Example:
    """One contaminated eval instance shown as evidence."""
    instance_id: str
    eval_row: int
    text: str                           # the instance's full text
    spans: tuple[Span, ...]             # overlapping spans in `text`, merged for display
    token_overlap: float                # HELM token metric of this instance, 0..1
    hits: tuple[TrainHit, ...]          # at most MAX_HITS are shown
    same_text: int = 0                  # other instances of the dataset with exactly this text
    longest_match: int = 0              # longest run of its tokens covered by one training row's n-grams


@dataclass(frozen=True)
class TrainFileCount:
    """A training file and what it overlaps at one n."""
    path: str
    instances: int                      # instances of the dataset it overlaps at this n
    train_rows: int                     # its rows that overlap them at this n


@dataclass(frozen=True)
class NgramCount:
    """An overlapping n-gram at one n and how widely it is shared."""
    ngram: str
    instances: int                      # instances of the dataset that have it
    train_rows: int                     # training rows (documents) that have it


@dataclass(frozen=True)
class NResult:
    """One eval dataset at one n: counts and HELM's metrics (means), and the evidence."""
    n: int
    num_instances: int
    contaminated: int
    binary: float
    jaccard: float
    token: float
    jaccard_weighted: float
    token_weighted: float
    train_rows: int = 0                             # training rows overlapping its instances at this n
    top_train_files: tuple[TrainFileCount, ...] = ()     # most instances first
    top_ngrams: tuple[NgramCount, ...] = ()         # most instances first
    examples: tuple[Example, ...] = ()              # most contaminated at this n first


@dataclass(frozen=True)
class DatasetReport:
    """One eval dataset: counts and its results per n."""
    name: str
    eval_paths: tuple[str, ...]
    num_rows: int
    num_instances: int
    num_empty_instances: int
    num_bad_rows: int
    results: tuple[NResult, ...]                    # one per n, ascending n


@dataclass(frozen=True)
class ContaminationReport:
    """Everything the page shows."""
    title: str
    settings: tuple[tuple[str, str], ...]           # ordered (name, value)
    inputs: tuple[tuple[str, str, str], ...]        # (side "eval"|"train", path, fingerprint text)
    rows_read: tuple[tuple[str, int], ...]          # (what, count)
    datasets: tuple[DatasetReport, ...]
    generated_by: str                               # e.g. "refinery decon 0.1.0"; no timestamps


# ---------------------------------------------------------------------------------------
# Text: escaping, spans, windows, highlighting
# ---------------------------------------------------------------------------------------

# C0 controls (but tab, LF, FF, CR) and DEL are not allowed in HTML text: one U+FFFD each
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F]}


def esc(text: str) -> str:
    """HTML-escaped text (quotes too), valid as UTF-8: controls -> U+FFFD, lone surrogates -> ``?``."""
    out = html.escape(text.translate(_CONTROLS), quote=True)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        out = out.encode("utf-8", "replace").decode("utf-8")
    return out


def cut(text: str, max_chars: int = MAX_LABEL_CHARS) -> str:
    """``text`` itself, or its first ``max_chars - 1`` characters and an ellipsis."""
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def label(text: str) -> str:
    """A name, path, id or setting: cut, escaped, and isolated in ``<bdi>`` so that bidi
    controls in it (U+202E) cannot reorder the text around it."""
    return f"<bdi>{esc(cut(text))}</bdi>"


def merge_spans(spans: Iterable[Span], length: int) -> list[tuple[int, int]]:
    """Spans clamped to ``[0, length)``, empty ones dropped, overlapping or adjacent ones merged, sorted."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((max(0, s.start), min(length, s.end)) for s in spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def text_window(length: int, spans: list[tuple[int, int]], max_chars: int) -> tuple[int, int]:
    """The ``[start, end)`` part of a text to show: all of it if it fits, else ``max_chars`` around the spans.

    ``spans`` are merged and sorted. When they all fit, the window centres them; otherwise it
    starts :data:`CONTEXT_CHARS` before the first one.
    """
    if length <= max_chars:
        return 0, length
    if not spans:
        return 0, max_chars
    lo, hi = spans[0][0], spans[-1][1]
    start = lo - (max_chars - (hi - lo)) // 2 if hi - lo <= max_chars else lo - CONTEXT_CHARS
    start = max(0, min(start, length - max_chars))
    return start, start + max_chars


def highlight(text: str, spans: list[tuple[int, int]], start: int, end: int) -> str:
    """HTML of ``text[start:end]`` with the parts of ``spans`` inside it in ``<mark>``.

    ``spans`` are merged and sorted. Works on the raw text; each piece is escaped on its own.
    """
    out = []
    pos = start
    for s, e in spans[bisect.bisect_right(spans, start, key=lambda span: span[1]):]:
        if s >= end:
            break
        s, e = max(s, start), min(e, end)
        if s > pos:
            out.append(esc(text[pos:s]))
        out.append(f"<mark>{esc(text[s:e])}</mark>")
        pos = e
    if pos < end:
        out.append(esc(text[pos:end]))
    return "".join(out)


def word_bounds(text: str, spans: list[tuple[int, int]], start: int, end: int, cut_before: bool,
                cut_after: bool) -> tuple[int, int]:
    """``[start, end)`` moved inward so that a cut text starts and ends on whole words.

    A cut start (``start > 0``, or ``cut_before``: the text goes on before) inside a word
    moves past that word's rest, then past any whitespace; a cut end likewise, backwards.
    Each moves by at most :data:`WORD_SLACK` characters and never into a span (merged,
    sorted); a word longer than that stays cut.
    """
    if start > 0 or cut_before:
        first = bisect.bisect_right(spans, start, key=lambda span: span[1])
        limit = min(end, start + WORD_SLACK, spans[first][0] if first < len(spans) else end)
        if not (start > 0 and text[start - 1].isspace()):
            start = next((i for i in range(start, limit) if text[i].isspace()), start)
        while start < limit and text[start].isspace():
            start += 1
    if end < len(text) or cut_after:
        last = bisect.bisect_left(spans, end, key=lambda span: span[0])
        limit = max(start, end - WORD_SLACK, spans[last - 1][1] if last > 0 else start)
        if not (end < len(text) and text[end].isspace()):
            end = next((i + 1 for i in range(end - 1, limit - 1, -1) if text[i].isspace()), end)
        while end > limit and text[end - 1].isspace():
            end -= 1
    return start, end


def text_block(text: str, merged: list[tuple[int, int]], max_chars: int, cls: str, cut_before: bool = False,
               cut_after: bool = False) -> str:
    """A ``<div class=cls>`` with the (windowed) text highlighted, plus a note if it was cut.

    ``merged``: the text's spans as :func:`merge_spans` returns them; ``cut_before`` /
    ``cut_after``: ``text`` is itself a piece of a longer text (a snippet). A cut side starts
    or ends on a whole word (:func:`word_bounds`) and shows an ellipsis.
    """
    start, end = text_window(len(text), merged, max_chars)
    if not text:
        return f'<div class="{cls}"><span class="cut">(empty text)</span></div>'
    windowed = start > 0 or end < len(text)
    start, end = word_bounds(text, merged, start, end, cut_before, cut_after)
    lead = '<span class="cut">… </span>' if start > 0 or cut_before else ""
    tail = '<span class="cut"> …</span>' if end < len(text) or cut_after else ""
    block = f'<div class="{cls}">{lead}{highlight(text, merged, start, end)}{tail}</div>'
    if not windowed:
        return block
    note = f"Showing characters {start + 1:,}–{end:,} of {len(text):,}"
    outside = sum(1 for s, e in merged if e <= start or s >= end)
    if outside:
        note += f"; {plural(outside, 'highlighted span')} outside this window not shown"
    return block + f'<p class="note">{note}.</p>'


# ---------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------

def plural(count: int, noun: str) -> str:
    """``"1 instance"``, ``"1,319 instances"``."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def percent(part: int, total: int) -> str:
    """``part / total`` as a percentage with 1-2 decimals; ``"n/a"`` for an empty total."""
    if total <= 0:
        return "n/a"
    if part <= 0:
        return "0%"
    if part >= total:
        return "100%"
    p = 100.0 * part / total
    if p < 0.01:
        return "<0.01%"
    if p > 99.99:
        return ">99.99%"
    s = f"{p:.2f}"
    return s.removesuffix("0") + "%"


def metric(value: float) -> str:
    """A HELM metric (0..1) with 4 decimals; ``"n/a"`` when not finite."""
    return f"{value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def fingerprint_text(size: int, version: str, remote: bool) -> str:
    """An input's fingerprint for a reader: ``"size 241,537 bytes, modified 2025-01-02 03:04:05
    UTC"`` for a local file (its version is its mtime), ``"size 99 bytes, generation 1712..."``
    for a cloud object with a numbered generation, else the version as it is."""
    text = f"size {size:,} bytes"
    if not version:
        return text
    if not remote:
        try:
            return f"{text}, modified {datetime.fromtimestamp(float(version), timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
        except (ValueError, OverflowError, OSError):
            pass
    elif version.isdigit():
        return f"{text}, generation {version}"
    return f"{text}, version {version}"


def bar_width(part: int, total: int, width: int = BAR_WIDTH) -> float:
    """Filled width of a share bar: proportional, at least 1 px when anything is contaminated."""
    if total <= 0 or part <= 0:
        return 0.0
    return max(1.0, round(width * min(part, total) / total, 2))


def share_bar(part: int, total: int) -> str:
    """An inline SVG bar of ``part / total``."""
    w = bar_width(part, total)
    return (f'<svg class="bar" width="{BAR_WIDTH}" height="{BAR_HEIGHT}" viewBox="0 0 {BAR_WIDTH} {BAR_HEIGHT}" '
            f'role="img" aria-label="{percent(part, total)} contaminated">'
            f'<rect class="track" width="{BAR_WIDTH}" height="{BAR_HEIGHT}" rx="3" fill="#e7e5e4"/>'
            f'<rect class="fill" width="{w:.2f}" height="{BAR_HEIGHT}" rx="3" fill="#b45309"/></svg>')


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------

def _contaminated(ds: DatasetReport) -> int:
    """The most contaminated instances of a dataset over its n values (0 if none)."""
    return max((r.contaminated for r in ds.results), default=0)


def _lede(report: ContaminationReport) -> str:
    """The one sentence under the title."""
    datasets = report.datasets
    if not datasets:
        return "No eval datasets were read, so there is nothing to compare."
    instances = sum(ds.num_instances for ds in datasets)
    if instances == 0:
        return "The eval datasets have no instances, so there is nothing to measure."
    hit = sum(1 for ds in datasets if _contaminated(ds) > 0)
    if hit == 0:
        return (f"No contamination found: none of the {plural(instances, 'eval instance')} in "
                f"{plural(len(datasets), 'eval dataset')} shares an n-gram with the training data, at any n.")
    return (f"Contamination found in {hit:,} of {plural(len(datasets), 'eval dataset')}: "
            f"some of their instances share n-grams with the training data. The evidence is below.")


METRICS_COLUMNS = ("binary", "jaccard", "token", "jaccard (weighted)", "token (weighted)")


def evidence_id(index: int, n: int) -> str:
    """The anchor of dataset ``index``'s section at ``n`` (datasets count from 1)."""
    return f"evidence-{index}-n{n}"


def _glance_card(index: int, ds: DatasetReport) -> str:
    """One dataset in "At a glance": counts, per-n bars and metrics, links to its sections per n."""
    parts = [f'<section class="card" id="glance-{index}">', f"<h3>{label(ds.name)}</h3>"]
    paths = ", ".join(f"<code>{label(p)}</code>" for p in ds.eval_paths[:MAX_EVAL_PATHS])
    if len(ds.eval_paths) > MAX_EVAL_PATHS:
        paths += f" and {len(ds.eval_paths) - MAX_EVAL_PATHS:,} more"
    parts.append(f'<p class="sub">{"eval: " + paths + " · " if paths else ""}'
                 f"{plural(ds.num_rows, 'row')} · {plural(ds.num_instances, 'instance')} · "
                 f"{ds.num_empty_instances:,} empty or punctuation-only (never counted) · "
                 f"{ds.num_bad_rows:,} unreadable or without text</p>")
    if ds.num_instances == 0:
        parts.append('<p class="empty">This eval set has no instances, so there is nothing to measure.</p>')
    elif _contaminated(ds) == 0:
        parts.append('<p class="clean">No instance of this eval set shares an n-gram with the training data, '
                     'at any n.</p>')
    if ds.results:
        head = "".join(f'<th class="num">{c}</th>' for c in METRICS_COLUMNS)
        parts.append('<div class="scroll"><table class="metrics"><thead><tr><th class="num">n</th>'
                     f"<th>contaminated instances</th>{head}</tr></thead><tbody>")
        for r in ds.results:
            m = metric if r.num_instances > 0 else (lambda v: "n/a")      # a mean over no instances
            parts.append(
                f'<tr data-n="{r.n}" data-contaminated="{r.contaminated}" data-instances="{r.num_instances}">'
                f'<td class="num" data-label="n">{r.n:,}</td>'
                f'<td class="share" data-label="contaminated instances at n = {r.n:,}">'
                f'{share_bar(r.contaminated, r.num_instances)} '
                f'<span class="count">{r.contaminated:,} / {plural(r.num_instances, "instance")}, '
                f'{percent(r.contaminated, r.num_instances)}</span></td>'
                + "".join(f'<td class="num" data-label="{c} at n = {r.n:,}">{m(v)}</td>'
                          for c, v in zip(METRICS_COLUMNS, (r.binary, r.jaccard, r.token, r.jaccard_weighted,
                                                            r.token_weighted)))
                + "</tr>")
        parts.append("</tbody></table></div>")
        if _contaminated(ds) > 0:
            links = " · ".join(f'<a href="#{evidence_id(index, r.n)}">n = {r.n:,}</a>' for r in ds.results)
            parts.append(f'<p class="jump">Training files, frequent n-grams and examples at {links}</p>')
    else:
        parts.append('<p class="note">No results were recorded for this eval set.</p>')
    parts.append("</section>")
    return "\n".join(parts)


def _files_table(r: NResult) -> str:
    """The training files contributing most at ``r.n``."""
    n = f"n = {r.n:,}"
    parts = [f"<h5>Training files contributing most at {n}</h5>",
             '<div class="scroll"><table class="files"><thead><tr><th>training file</th>'
             f'<th class="num">instances at {n}</th><th class="num">training rows at {n}</th></tr></thead><tbody>']
    for f in r.top_train_files[:MAX_TOP_FILES]:
        parts.append(f'<tr><td><code>{label(f.path)}</code></td><td class="num">{f.instances:,}</td>'
                     f'<td class="num">{f.train_rows:,}</td></tr>')
    parts.append("</tbody></table></div>")
    if len(r.top_train_files) > MAX_TOP_FILES:
        parts.append(f'<p class="note">and {plural(len(r.top_train_files) - MAX_TOP_FILES, "more training file")} '
                     f"at {n}.</p>")
    return "\n".join(parts)


def _ngrams_table(r: NResult) -> str:
    """The most frequent overlapping n-grams at ``r.n``."""
    n = f"n = {r.n:,}"
    parts = [f"<h5>Most frequent overlapping n-grams at {n}</h5>",
             '<p class="sub">By the instances that have them, then the training rows; an n-gram many instances '
             "share is more likely a common phrase than a leak.</p>",
             '<div class="scroll"><table class="ngrams"><thead><tr><th>n-gram</th>'
             f'<th class="num">instances at {n}</th><th class="num">training rows</th></tr></thead><tbody>']
    for g in r.top_ngrams[:MAX_TOP_NGRAMS]:
        parts.append(f'<tr><td><code>{label(g.ngram)}</code></td><td class="num">{g.instances:,}</td>'
                     f'<td class="num">{g.train_rows:,}</td></tr>')
    parts.append("</tbody></table></div>")
    return "\n".join(parts)


def _at_n(index: int, ds: DatasetReport, r: NResult, shown: list[str], max_bytes: int) -> str:
    """Dataset ``index`` at one n: its counts there, the training files and n-grams behind them,
    its first examples (``shown``, rendered) or why there are none."""
    n = f"n = {r.n:,}"
    parts = [f'<section class="at-n" id="{evidence_id(index, r.n)}" data-n="{r.n}">',
             f"<h4>{label(ds.name)} at {n}</h4>"]
    if r.num_instances == 0:
        parts.append(f'<p class="empty">This eval set has no instances, so there is nothing to show at {n}.</p>')
    elif r.contaminated == 0:
        parts.append(f'<p class="clean">No instance overlaps the training data at {n}, so there is nothing '
                     "to show.</p>")
    else:
        parts.append(f'<p class="counts">At {n}: {r.contaminated:,} of {plural(r.num_instances, "instance")} '
                     f"({percent(r.contaminated, r.num_instances)}) share an n-gram with "
                     f"{plural(r.train_rows, 'training row')}.</p>")
        if r.top_train_files:
            parts.append(_files_table(r))
        if r.top_ngrams:
            parts.append(_ngrams_table(r))
        parts.append(f"<h5>Examples at {n}</h5>")
        if r.examples:
            selected = len(r.examples)
            parts.append(f'<p class="sub">The most contaminated instances at {n}, by longest match, then token '
                         f"overlap ({selected:,} selected).</p>")
            parts += shown
            if len(shown) < selected:
                parts.append(f'<p class="note omitted">Showing the first {len(shown):,} of '
                             f'{plural(selected, "example")} at {n}; {selected - len(shown):,} omitted to keep this '
                             f"page within {max_bytes:,} bytes.</p>")
        else:
            parts.append('<p class="note">No examples were selected for this report.</p>')
    parts.append("</section>")
    return "\n".join(parts)


def _hit_html(hit: TrainHit) -> str:
    """One training hit: path, row, shared n-grams, highlighted snippet."""
    snippet = text_block(hit.snippet, merge_spans(hit.snippet_spans, len(hit.snippet)), MAX_SNIPPET_CHARS,
                         "text snippet", hit.cut_before, hit.cut_after)
    return (f'<div class="hit"><p class="meta"><span class="k">training</span> <code>{label(hit.train_path)}</code>'
            f" · row {hit.train_row:,} · {plural(hit.ngrams, 'shared n-gram')}</p>"
            f"{snippet}</div>")


def example_html(ex: Example) -> str:
    """One example: meta line, highlighted text, its training hits."""
    merged = merge_spans(ex.spans, len(ex.text))
    parts = ['<article class="example">',
             (f'<p class="meta"><span class="k">instance</span> <code>{label(ex.instance_id)}</code>'
              f" · eval row {ex.eval_row:,} · longest match {plural(ex.longest_match, 'token')}"
              f" · token overlap (coverage) {metric(ex.token_overlap)}"
              f" · {plural(len(merged), 'highlighted span')}"
              + (f" · {plural(ex.same_text, 'other instance')} with exactly this text" if ex.same_text else "")
              + "</p>"),
             text_block(ex.text, merged, MAX_TEXT_CHARS, "text")]
    parts += [_hit_html(h) for h in ex.hits[:MAX_HITS]]
    if not ex.hits:
        parts.append('<p class="note">No training hit was recorded for this instance.</p>')
    elif len(ex.hits) > MAX_HITS:
        parts.append(f'<p class="note">{plural(len(ex.hits) - MAX_HITS, "more training hit")} not shown.</p>')
    parts.append("</article>")
    return "\n".join(parts)


def _evidence(index: int, ds: DatasetReport, shown: list[list[str]], max_bytes: int) -> str:
    """One dataset in "By n: the evidence": a section per n (``shown[k]``: the rendered examples
    of its k-th n), or why there are none."""
    parts = [f'<section class="evidence" id="evidence-{index}">', f"<h3>{label(ds.name)}</h3>"]
    if ds.num_instances == 0:
        parts.append('<p class="empty">This eval set has no instances, so there is nothing to show.</p>')
    elif _contaminated(ds) == 0:
        parts.append('<p class="clean">No instance overlaps the training data, so there is nothing to show.</p>')
    else:
        links = " · ".join(f'<a href="#{evidence_id(index, r.n)}">n = {r.n:,}</a>' for r in ds.results)
        parts.append(f'<nav class="by-n">{links}</nav>')
        parts += [_at_n(index, ds, r, shown[k], max_bytes) for k, r in enumerate(ds.results)]
    parts.append("</section>")
    return "\n".join(parts)


def _kv_table(rows: list[tuple[str, str]]) -> str:
    """A two-column table of already escaped cells."""
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<div class="scroll"><table class="kv"><tbody>{body}</tbody></table></div>'


def _settings(report: ContaminationReport) -> str:
    """The settings, inputs with fingerprints and rows read."""
    parts = ['<section id="settings"><h2>Settings</h2>',
             '<p class="sub">What this run read and how, so that it can be reproduced.</p>']
    if report.settings:
        parts.append(_kv_table([(label(k), label(v)) for k, v in report.settings[:MAX_SETTINGS]]))
        if len(report.settings) > MAX_SETTINGS:
            more = len(report.settings) - MAX_SETTINGS
            parts.append(f'<p class="note">{plural(more, "more setting")} not listed.</p>')
    else:
        parts.append('<p class="note">No settings were recorded.</p>')
    parts.append("<h3>Inputs</h3>")
    shown: dict[str, int] = {}
    hidden: dict[str, int] = {}
    rows = []
    for side, path, fingerprint in report.inputs:
        if shown.get(side, 0) < MAX_INPUTS_PER_SIDE:
            shown[side] = shown.get(side, 0) + 1
            rows.append(f"<tr><td>{label(side)}</td><td><code>{label(path)}</code></td>"
                        f"<td>{label(fingerprint)}</td></tr>")
        else:
            hidden[side] = hidden.get(side, 0) + 1
    if rows:
        parts.append('<div class="scroll"><table class="inputs"><thead><tr><th>side</th><th>path</th>'
                     f"<th>fingerprint</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>")
        for side, count in hidden.items():
            parts.append(f'<p class="note">{plural(count, "more " + label(side) + " input")} not listed.</p>')
    else:
        parts.append('<p class="note">No inputs were recorded.</p>')
    parts.append("<h3>Rows read</h3>")
    if report.rows_read:
        parts.append(_kv_table([(label(k), f"{v:,}") for k, v in report.rows_read[:MAX_ROWS_READ]]))
    else:
        parts.append('<p class="note">No row counts were recorded.</p>')
    parts.append("</section>")
    return "\n".join(parts)


_CSS = """\
*{box-sizing:border-box}
body{margin:0;background:#f6f6f4;color:#1f2328;
font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1000px;margin:0 auto;padding:24px 20px 48px}
bdi{unicode-bidi:isolate}
h1{font-size:1.6rem;margin:0 0 .3rem}
h2{font-size:1.25rem;margin:2.2rem 0 .8rem;padding-bottom:.3rem;border-bottom:1px solid #d0d7de}
h3{font-size:1.05rem;margin:0 0 .3rem;overflow-wrap:anywhere}
h4{font-size:1rem;margin:1.2rem 0 .3rem;overflow-wrap:anywhere}
h5{font-size:.92rem;margin:.9rem 0 .3rem}
a{color:#0a58a8}
.lede{font-size:1.05rem;margin:.2rem 0 .6rem}
.card,.evidence,.example{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:14px 16px;margin:0 0 14px}
.evidence{background:transparent;border:0;padding:0;margin:1.2rem 0 0}
.at-n{border-top:2px solid #d0d7de;margin:1rem 0 0;padding-top:.2rem}
.at-n:target{border-top-color:#b45309}
.jump,.by-n{font-size:.9rem;margin:.4rem 0}
.sub,.note{color:#57606a;font-size:.88rem;margin:.2rem 0 .6rem}
.empty,.clean{border-radius:6px;padding:6px 10px;margin:.4rem 0}
.empty{background:#f3f4f6}
.clean{background:#ecf6ec}
.scroll{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:.9rem;margin:.3rem 0}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eaeef2;vertical-align:top}
th{font-weight:600;color:#424a53}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
th.num{white-space:normal}
.count{white-space:nowrap;display:inline-block}
.bar{vertical-align:middle;margin-right:6px}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.85em;overflow-wrap:anywhere}
.text{white-space:pre-wrap;overflow-wrap:anywhere;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
font-size:.84rem;line-height:1.45;background:#fafaf9;border:1px solid #eaeef2;border-radius:6px;padding:8px 10px;
margin:.3rem 0;max-height:28rem;overflow:auto}
mark,.swatch{background:#fcd34d;color:#1f2328;border-radius:2px;padding:0 1px}
.cut{color:#8c959f}
.meta{margin:0 0 .2rem;font-size:.9rem}
.k{color:#57606a}
.hit{margin:.6rem 0 0;padding-left:12px;border-left:3px solid #d0d7de}
footer{margin-top:2.5rem;color:#57606a;font-size:.85rem}
@media (max-width:640px){
main{padding:16px 10px 32px}
.card{padding:12px 10px}
table.metrics,table.metrics tbody,table.metrics tr,table.metrics td{display:block;width:100%}
table.metrics thead{display:none}
table.metrics tr{border-bottom:1px solid #d0d7de;padding:4px 0}
table.metrics td{display:flex;justify-content:space-between;gap:8px;border:0;padding:1px 0}
table.metrics td::before{content:attr(data-label);font-weight:600;color:#424a53;text-align:left;white-space:normal}
table.metrics td.share{display:block}
table.metrics td.share::before{display:block}
}
@media print{body{background:#fff}.card,.example{break-inside:avoid}.text{max-height:none}}
"""


def _page(report: ContaminationReport, shown_datasets: int, shown: list[list[list[str]]], max_bytes: int) -> str:
    """The whole page: the first ``shown_datasets`` datasets, ``shown[i][k]`` the rendered examples
    of dataset i at its k-th n."""
    datasets = report.datasets[:shown_datasets]
    omitted = len(report.datasets) - shown_datasets
    omitted_note = (f'<p class="note omitted">{plural(omitted, "more eval dataset")} not shown to keep this page '
                    f"within {max_bytes:,} bytes; all numbers are in the stats files beside it.</p>") if omitted else ""
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f'<meta name="generator" content="{esc(cut(report.generated_by))}">',
             f"<title>{esc(cut(report.title))}</title>", f"<style>\n{_CSS}</style>", "</head>", "<body>", "<main>",
             f"<header><h1>{label(report.title)}</h1>", f'<p class="lede">{_lede(report)}</p>',
             ('<nav><a href="#glance">At a glance</a> · <a href="#evidence">By n: the evidence</a> · '
              '<a href="#settings">Settings</a></nav></header>'),
             '<section id="glance"><h2>At a glance</h2>',
             ('<p class="sub">Per eval dataset and n: the share of instances that share at least one n-gram '
              "with the training data, and HELM's metrics (means over instances). binary: the instance overlaps; "
              "jaccard: overlapping n-grams / all its n-grams; token: its tokens covered by an overlapping n-gram; "
              "weighted: each overlapping n-gram counts 1 / (training documents containing it).</p>")]
    if not report.datasets:
        parts.append('<p class="empty">No eval datasets were read.</p>')
    parts += [_glance_card(i + 1, ds) for i, ds in enumerate(datasets)]
    if omitted_note:
        parts.append(omitted_note)
    parts += ["</section>", '<section id="evidence"><h2>By n: the evidence</h2>',
              ('<p class="sub">Per eval dataset, a section per n: what overlaps at that n, and the instances that '
               "overlap most with their training hits.</p>"),
              ('<p class="legend"><span class="swatch">Highlighted</span> text is part of an n-gram that also '
               "occurs in the training data. Rows are numbered from 0 (a file's first row is row 0), as in the "
               "stats files; an instance without an id is named by its file and row.</p>")]
    if not report.datasets:
        parts.append('<p class="empty">No eval datasets were read, so there is no evidence to show.</p>')
    parts += [_evidence(i + 1, ds, shown[i], max_bytes) for i, ds in enumerate(datasets)]
    if omitted_note:
        parts.append(omitted_note)
    parts += ["</section>", _settings(report),
              (f"<footer>Generated by {label(report.generated_by)}. This page is self-contained: "
               "no scripts, nothing fetched.</footer>"), "</main>", "</body>", "</html>", ""]
    return "\n".join(parts)


def _notice_page(report: ContaminationReport, max_bytes: int) -> str:
    """The last resort: a short page saying the report did not fit."""
    title = esc(cut(report.title, 200))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{title}</title>\n</head>\n<body>\n<h1>{title}</h1>\n"
            f"<p>This report does not fit in {max_bytes:,} bytes even without its examples; "
            "the numbers are in the stats files beside it (report.md and the .jsonl files).</p>\n"
            f"<p>Generated by {esc(cut(report.generated_by, 200))}.</p>\n</body>\n</html>\n")


# ---------------------------------------------------------------------------------------
# Fitting the page into max_bytes
# ---------------------------------------------------------------------------------------

def _nbytes(text: str) -> int:
    """UTF-8 size (the rendered pieces are always encodable)."""
    return len(text.encode("utf-8"))


def fit_examples(counts: list[int], size: Callable[[int, int], int], budget: int) -> list[int]:
    """How many leading examples of each group (a dataset at one n) fit in ``budget`` bytes,
    taken round robin.

    ``counts[d]``: the examples of group d; ``size(d, i)``: the bytes of its i-th one (asked
    for in increasing i). Round i offers every group its i-th example; a group whose
    next example does not fit takes no more, so each keeps a prefix of its list (its most
    contaminated ones).
    """
    shown = [0] * len(counts)
    open_ = [True] * len(counts)
    for i in range(max(counts, default=0)):
        for d, count in enumerate(counts):
            if open_[d] and i < count:
                cost = size(d, i)
                if cost <= budget:
                    shown[d] += 1
                    budget -= cost
                else:
                    open_[d] = False
    return shown


def render_html(report: ContaminationReport, max_bytes: int = 2_000_000) -> str:
    """The whole report page; its UTF-8 encoding is at most ``max_bytes`` bytes.

    Deterministic: the same report gives the same string. Raises ``ValueError`` when
    ``max_bytes`` is below :data:`MIN_MAX_BYTES`. Examples are rendered only as far as
    they are offered a place on the page.
    """
    if max_bytes < MIN_MAX_BYTES:
        raise ValueError(f"max_bytes must be at least {MIN_MAX_BYTES}, got {max_bytes}")
    total = len(report.datasets)

    def none_shown(k: int) -> list[list[list[str]]]:
        return [[[] for _ in ds.results] for ds in report.datasets[:k]]

    def skeleton(k: int) -> str:
        return _page(report, k, none_shown(k), max_bytes)

    k = total
    if _nbytes(skeleton(k)) > max_bytes:
        if _nbytes(skeleton(0)) > max_bytes:
            return _notice_page(report, max_bytes)
        lo, hi = 0, total - 1          # the largest k whose page without examples fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _nbytes(skeleton(mid)) <= max_bytes else (lo, mid - 1)
        k = lo
    groups = [(d, j) for d in range(k) for j in range(len(report.datasets[d].results))]  # (dataset, its n)
    rendered: list[list[str]] = [[] for _ in groups]

    def size(g: int, i: int) -> int:
        d, j = groups[g]
        rendered[g].append(example_html(report.datasets[d].results[j].examples[i]))
        return _nbytes(rendered[g][-1]) + 1           # + 1: the joining newline

    def page_of(shown: list[int]) -> str:
        chosen = none_shown(k)
        for g, (d, j) in enumerate(groups):
            chosen[d][j] = rendered[g][:shown[g]]
        return _page(report, k, chosen, max_bytes)

    budget = max_bytes - _nbytes(skeleton(k)) - _SLACK_PER_GROUP * len(groups)
    shown = fit_examples([len(report.datasets[d].results[j].examples) for d, j in groups], size, budget)
    page = page_of(shown)
    while _nbytes(page) > max_bytes and any(shown):   # a safety net; the slack normally covers it
        g = max(range(len(groups)), key=lambda i: (shown[i], -i))
        shown[g] -= 1
        page = page_of(shown)
    return page
