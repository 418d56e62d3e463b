"""What the reports show: overlapping instances, report.md and the data of report.html."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from refinery.transforms.decon import report_html as rh

from .ids import shown_id
from .index import EvalRow, SameText, same_text
from .reduce import SNIPPET_CONTEXT, SNIPPET_MAX_CHARS, ReduceResult
from .steering import steering_lines


def overlap_instance(r: EvalRow) -> dict[str, Any]:
    """The line of ``overlap_instances.jsonl.gz`` for an eval row: its text, written once."""
    return {"eval_dataset": r.eval_dataset, "eval_path": r.eval_path, "eval_row": r.eval_row,
            "instance_id": r.instance_id, "eval_text": r.text}


def overlap_instances(eval_rows: list[EvalRow], overlaps: Mapping[int, object], same: SameText | None = None,
                      metrics: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """The lines of ``overlap_instances.jsonl.gz``: each overlapping eval row with its text, in
    eval order; a text shared by several rows once, on its first row's line, which lists the
    others under ``same_text`` (their detail records are that row's). With the run's
    ``metrics`` (:attr:`ReduceResult.metrics`, each row's per configured n), each line has
    ``by_n``: per configured n, ``{"n", "longest_match", "coverage"}`` (:mod:`.longest`)."""
    same = same_text(eval_rows) if same is None else same
    per_row = len(metrics) // len(eval_rows) if metrics and eval_rows else 0
    for r in eval_rows:
        if r.eval_idx not in overlaps or r.eval_idx in same.first:
            continue
        line = overlap_instance(r)
        if per_row and metrics:
            line["by_n"] = [{"n": m["n"], "longest_match": m["longest_match"], "coverage": m["coverage"]}
                            for m in metrics[r.eval_idx * per_row:(r.eval_idx + 1) * per_row]]
        if r.eval_idx in same.others:
            line["same_text"] = [{k: v for k, v in overlap_instance(eval_rows[i]).items() if k != "eval_text"}
                                 for i in same.others[r.eval_idx]]
        yield line


def capped_warning(capped: list[Any], max_ngram_details: int | None) -> str:
    """One sentence on the n-grams whose detail records were capped ("" when none was)."""
    if not capped:
        return ""
    left_out = sum(c[3] - c[2] for c in capped)
    n, gram, _, total = capped[0]
    shown = gram if len(gram) <= 60 else gram[:59] + "…"
    return (f"{len(capped):,} n-gram(s) had more than {max_ngram_details:,} detail records (eval rows x training "
            f"rows); {left_out:,} records were left out of the detail records (the stats and metrics count "
            f"them all). The largest: {shown!r} (n={n}, {total:,} records). Raise --max-ngram-details to keep "
            f"them, or ignore such n-grams with --max-train-count.")


def longest_examples(metrics: list[dict[str, Any]], top: int, n: int | None = None) -> list[dict[str, Any]]:
    """Per eval dataset (sorted), its ``top`` overlapping instances at ``n`` (default: the
    largest n), by longest match, then coverage, then eval order: the metrics rows
    (:attr:`ReduceResult.metrics`)."""
    if not metrics:
        return []
    n = max(m["n"] for m in metrics) if n is None else n
    by_ds: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for i, m in enumerate(metrics):
        if m["n"] == n and m["binary"]:
            by_ds[m["eval_dataset"]].append((i, m))
    out = []
    for ds in sorted(by_ds):
        ranked = sorted(by_ds[ds], key=lambda im: (-im[1]["longest_match"], -im[1]["coverage"], im[0]))
        out += [m for _, m in ranked[:top]]
    return out


def row_id(r: EvalRow) -> str:
    """The id the reports show for eval row ``r`` (:func:`.ids.shown_id`)."""
    return shown_id(r.instance_id, r.eval_path, r.eval_row, r.hashed_id)


def frequent_ngrams(result: ReduceResult, rows: list[EvalRow], n: int, same: SameText,
                    top: int = rh.MAX_TOP_NGRAMS) -> list[rh.NgramCount]:
    """The ``top`` overlapping n-grams of ``rows`` (one eval dataset) at configured ``n`` (a row
    shorter than n: its whole text), by the instances that have them, then the training rows
    that have them, then their text: a phrase many instances share (boilerplate) comes first."""
    ids_of: dict[int, set[str]] = defaultdict(set)  # a text (its first row) -> the instance ids of its rows here
    length: dict[int, int] = {}                      # ... -> its n-gram length at n
    for r in rows:
        first = same.first_of(r.eval_idx)
        ids_of[first].add(r.instance_id)
        length[first] = min(n, r.num_tokens)
    instances: dict[str, set[str]] = {}  # n-gram -> instance ids: a text's own set until another text adds
    owned: set[str] = set()              # the n-grams whose set is a copy of their own
    train_rows: dict[str, int] = {}
    for first, ids in ids_of.items():
        for gram, count in result.overlaps.get(first, {}).get(length[first], {}).items():
            seen = instances.get(gram)
            if seen is None:
                instances[gram] = ids
            elif gram in owned:
                seen |= ids
            else:
                instances[gram] = seen | ids
                owned.add(gram)
            train_rows[gram] = count
    ranked = sorted(instances, key=lambda g: (-len(instances[g]), -train_rows[g], g))[:top]
    return [rh.NgramCount(g, len(instances[g]), train_rows[g]) for g in ranked]


def top_train_files(result: ReduceResult) -> dict[tuple[str, int], list[rh.TrainFileCount]]:
    """Per (eval dataset, n): its training files, by the instances they overlap at n (most
    first), then path, with the training rows that overlap them at n."""
    files: dict[tuple[str, int], list[rh.TrainFileCount]] = defaultdict(list)
    for row in result.by_train_path:
        files[(row["eval_dataset"], row["n"])].append(
            rh.TrainFileCount(row["train_path"], row["num_instances"], row["num_train_rows"]))
    return {key: sorted(fs, key=lambda f: (-f.instances, f.path)) for key, fs in files.items()}


def _md_cell(text: str, max_chars: int = 80) -> str:
    """``text`` on one line, cut at ``max_chars``, safe in a markdown table cell and as UTF-8
    (a lone surrogate, from text that was not valid UTF-8, becomes ``?``)."""
    one = " ".join(text.encode("utf-8", "replace").decode("utf-8").split())
    one = one if len(one) <= max_chars else one[:max_chars - 1] + "…"
    return one.replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")


def _md_spans(text: str, offsets: list[Any], base: int = 0, most: int = 3) -> str:
    """The first ``most`` merged spans of ``offsets`` (relative to ``text``, shown ``+ base``):
    ``[start, end) "text"``, and how many more."""
    spans = rh.merge_spans([rh.Span(a, b) for a, b in offsets], len(text))
    shown = "; ".join(f'[{base + a}, {base + b}) "{_md_cell(text[a:b])}"' for a, b in spans[:most])
    return shown + (f"; and {len(spans) - most} more" if len(spans) > most else "")


def _md_evidence(result: ReduceResult, rows: dict[tuple[str, int], EvalRow], same: SameText,
                 chosen: list[dict[str, Any]], n: int) -> list[str]:
    """Each chosen instance at ``n`` (its metrics row) with its overlapping spans and its first
    training rows' (path, row, offsets and text on both sides)."""
    lines = []
    for m in chosen:
        r = rows.get((m["eval_path"], m["eval_row"]))
        if r is None:
            continue
        first, length = same.first_of(r.eval_idx), min(n, r.num_tokens)
        lines.append(f"- `{_md_cell(row_id(r))}` (eval row {r.eval_row}), eval text "
                     f"{_md_spans(r.text, result.spans.get(first, {}).get(length, []))}")
        for _, train_row, path, row_hits in result.samples.get(first, {}).get(length, []):
            snippet = merged_snippet(row_hits)
            lines.append(f"  - training `{_md_cell(path, 200)}` row {train_row}: "
                         f"{_md_spans(snippet.text, snippet.spans, snippet.start)}")
    return lines


def render_report(result: ReduceResult, scan_stats: dict[str, Any], max_train_count: int | None, top: int = 5,
                  max_ngram_details: int | None = None, eval_rows: list[EvalRow] | None = None) -> str:
    """A short human-readable report. Every count names its n: per dataset and n the
    contaminated instances, the training rows and files behind them; then per dataset and n
    (a section each: :func:`_md_section`) the most frequent overlapping n-grams, the ``top``
    instances with the longest match (:func:`longest_examples`) and, given ``eval_rows``, their
    evidence (spans and training rows, offsets and text on both sides)."""
    files = top_train_files(result)
    lines = _md_counts(result, scan_stats, max_train_count, max_ngram_details, top, files)
    if not any(s["instance_ids"] for s in result.overlap_stats):
        return "\n".join(lines) + "\n"
    lines += ["", "longest match: the longest run of eval tokens covered by the n-grams of one training row; "
              "coverage: the share of the eval tokens covered by any overlapping n-gram (HELM's token metric). "
              "Offsets are [start, end) characters; rows count from 0."]
    same = same_text(eval_rows) if eval_rows is not None else SameText({}, {})
    by_ds: dict[str, list[EvalRow]] = defaultdict(list)
    for r in eval_rows or []:
        by_ds[r.eval_dataset].append(r)
    rows = {(r.eval_path, r.eval_row): r for r in eval_rows or []}
    for s in result.overlap_stats:
        if s["num_instances"]:
            lines += _md_section(result, s, files.get((s["eval_dataset"], s["n"]), []),
                                 by_ds[s["eval_dataset"]] if eval_rows is not None else None, rows, same, top)
    return "\n".join(lines) + "\n"


def _md_counts(result: ReduceResult, scan_stats: dict[str, Any], max_train_count: int | None,
               max_ngram_details: int | None, top: int, files: dict[tuple[str, int], list[rh.TrainFileCount]]
               ) -> list[str]:
    """The report's head: what was scanned, the table of contaminated instances per dataset and
    n, the clean instances, the empty and unreadable rows."""
    ns = sorted({s["n"] for s in result.overlap_stats})
    lines = ["# Train/test overlap report", ""]
    lines.append(f"training rows scanned: {scan_stats.get('rows', 0)}, "
                 f"text: {scan_stats.get('text_bytes', 0) / 1e6:.1f} MB, "
                 f"training rows with overlaps at any n (as scanned): {scan_stats.get('rows_with_hits', 0)}")
    if ns:
        lines.append("training rows with overlaps: " + ", ".join(
            f"{result.train_rows_at_n.get(n, 0)} at n = {n}" for n in ns))
    if max_train_count is not None:
        lines.append(f"n-grams ignored (in more than {max_train_count} training documents): {result.ignored_ngrams}")
        hidden = [s for s in result.overlap_stats if s.get("num_instances_ignored_only")]
        lines += [f"- {s['eval_dataset']} at n = {s['n']}: {s['num_instances_ignored_only']} instance(s) overlap the "
                  f"training data only through ignored n-grams, so no training row is listed for them: "
                  + ", ".join(_md_cell(i) for i in s["instance_ids_ignored_only"][:top])
                  + (f", and {s['num_instances_ignored_only'] - top} more" if s["num_instances_ignored_only"] > top
                     else "") for s in hidden]
    if result.capped:
        lines.append(f"detail records capped: {capped_warning(result.capped, max_ngram_details)}")
    if result.steering is not None:  # boilerplate that hit many training rows, and the K that ignores it
        lines += ["", *(f"**{line[0].upper()}{line[1:]}**" if i == 0 else line
                        for i, line in enumerate(steering_lines(result.steering.record())))]
    lines.append("")
    lines.append("| eval_dataset | n | contaminated instances at n | instances | % | training rows at n "
                 "| top training files at n (instances at n) |")
    lines.append("|---|---|---|---|---|---|---|")
    for s in result.overlap_stats:
        ds, n = s["eval_dataset"], s["n"]
        k, total = len(s["instance_ids"]), s["num_instances"]
        pct = 100.0 * k / total if total else 0.0
        at_n = files.get((ds, n), [])
        tops = ", ".join(f"{f.path} ({f.instances})" for f in at_n[:top]) or "-"
        lines.append(f"| {ds} | {n} | {k} | {total} | {pct:.2f} | {sum(f.train_rows for f in at_n)} | {tops} |")
    lines.append("")
    clean = [s for s in result.overlap_stats if "num_clean_instances" in s]  # ngrams.clean.note_clean
    if clean:
        lines += ["clean instances (no overlap at n; rows too short or empty are not checked, so not clean), "
                  "in stats/clean/<eval_dataset>/n=<n>.jsonl.gz: " + ", ".join(
                      f"{s['eval_dataset']} {s['num_clean_instances']} at n = {s['n']}" for s in clean), ""]
    for ds, s in sorted({s["eval_dataset"]: s for s in result.summary}.items()):
        if s["num_empty_instances"] or s["num_bad_rows"]:
            lines.append(f"- {ds}: {s['num_empty_instances']} empty/punctuation-only instances (never counted "
                         f"as overlapping), {s['num_bad_rows']} unreadable rows or rows without text")
    return lines


def _md_section(result: ReduceResult, s: dict[str, Any], at_n: list[rh.TrainFileCount], ds_rows: list[EvalRow] | None,
                rows: dict[tuple[str, int], EvalRow], same: SameText, top: int) -> list[str]:
    """The section of one line ``s`` of the overlap stats (an eval dataset at n, with instances):
    its frequent n-grams (of its eval rows ``ds_rows``, when known), its ``top`` longest matches
    and their evidence."""
    ds, n = s["eval_dataset"], s["n"]
    k, total = len(s["instance_ids"]), s["num_instances"]
    lines = ["", f"## {ds} at n = {n}", ""]
    if not k:
        lines.append(f"No instance overlaps the training data at n = {n}.")
        return lines
    lines.append(f"{k} of {total} instances ({100.0 * k / total:.2f}%) share an n-gram with "
                 f"{sum(f.train_rows for f in at_n)} training rows at n = {n}.")
    grams = frequent_ngrams(result, ds_rows, n, same) if ds_rows is not None else []
    if grams:
        lines += ["", f"Most frequent overlapping n-grams at n = {n}:", "",
                  f"| n-gram | instances at n = {n} | training rows |", "|---|---|---|"]
        lines += [f"| {_md_cell(g.ngram)} | {g.instances} | {g.train_rows} |" for g in grams]
    chosen = [m for m in longest_examples(result.metrics, top, n) if m["eval_dataset"] == ds]
    lines += ["", f"Longest matches at n = {n}:", "",
              "| eval_dataset | instance_id | eval_row | longest match (tokens) | coverage |",
              "|---|---|---|---|---|"]
    for m in chosen:
        found = rows.get((m["eval_path"], m["eval_row"]))
        cell = _md_cell(row_id(found) if found is not None else str(m["instance_id"]), 200)
        lines.append(f"| {m['eval_dataset']} | {cell} | {m['eval_row']} | {m['longest_match']} | "
                     f"{m['coverage']:.4f} |")
    evidence = _md_evidence(result, rows, same, chosen, n)
    if evidence:
        lines += ["", f"Evidence at n = {n}:", "", *evidence]
    return lines


@dataclass(frozen=True)
class MergedSnippet:
    text: str
    spans: list[tuple[int, int]]   # offsets relative to ``text``
    cut_before: bool               # the training text goes on before ``text``
    cut_after: bool                # ... and (as far as the hits tell) after it
    start: int = 0                 # the offset of ``text`` in the training text


def merged_snippet(hits: list[Any]) -> MergedSnippet:
    """One snippet of a training row from its hits ``[ngram, offsets, snippet_start, snippet]``:
    the earliest snippet extended by those that overlap or touch it, and every occurrence
    inside it (offsets relative to the snippet). An occurrence longer than a snippet can
    hold (:data:`SNIPPET_MAX_CHARS`) is shown up to the snippet's end. ``cut_after`` is
    false when the last snippet is shorter than its hit asked for: the text ended there."""
    pieces = []
    for h in hits:
        want = h[1][0][1] + SNIPPET_CONTEXT - h[2]       # its first occurrence's end + the context
        pieces.append((h[2], h[3], want > SNIPPET_MAX_CHARS, len(h[3]) >= min(want, SNIPPET_MAX_CHARS)))
    pieces.sort()
    lo, text, clipped, goes_on = pieces[0]
    for start, piece, piece_clipped, piece_goes_on in pieces[1:]:
        end = lo + len(text)
        if start > end:
            break
        if start + len(piece) > end:
            text += piece[end - start:]
            clipped, goes_on = piece_clipped, piece_goes_on
    hi = lo + len(text)
    spans = [(s - lo, min(e, hi) - lo) for h in hits for s, e in h[1] if lo <= s and (e <= hi or clipped and s < hi)]
    return MergedSnippet(text, spans, lo > 0, goes_on, lo)


def examples_at(result: ReduceResult, rows: list[EvalRow], ns: list[int], k: int, examples: int,
                same: SameText) -> list[rh.Example]:
    """The ``examples`` most contaminated instances of ``rows`` (one eval dataset) at ``ns[k]``
    (by longest match, then HELM's token metric, then eval order; a text once), each with its
    overlapping spans at that n and its first two training rows there (scan order)."""
    n = ns[k]
    at = {r.eval_idx: result.metrics[r.eval_idx * len(ns) + k] for r in rows}
    ranked = sorted((r for r in rows if at[r.eval_idx]["binary"]),
                    key=lambda r: (-at[r.eval_idx].get("longest_match", 0), -at[r.eval_idx]["token"], r.eval_idx))
    copies = Counter(r.text for r in ranked)
    chosen: dict[str, EvalRow] = {}
    for r in ranked:
        if len(chosen) == examples:
            break
        chosen.setdefault(r.text, r)
    shown = []
    for r in chosen.values():
        first, length = same.first_of(r.eval_idx), min(n, r.num_tokens)
        hits = []
        for _, row, path, row_hits in result.samples.get(first, {}).get(length, []):
            snippet = merged_snippet(row_hits)
            hits.append(rh.TrainHit(path, row, snippet.text, tuple(rh.Span(a, b) for a, b in snippet.spans),
                                    len({h[0] for h in row_hits}), snippet.cut_before, snippet.cut_after))
        spans = tuple(rh.Span(a, b) for a, b in result.spans.get(first, {}).get(length, []))
        shown.append(rh.Example(row_id(r), r.eval_row, r.text, spans, at[r.eval_idx]["token"], tuple(hits),
                                copies[r.text] - 1, at[r.eval_idx].get("longest_match", 0)))
    return shown


def contamination_report(result: ReduceResult, eval_rows: list[EvalRow], ns: list[int], examples: int,
                         settings: tuple[tuple[str, str], ...], inputs: tuple[tuple[str, str, str], ...],
                         scan_stats: dict[str, Any]) -> rh.ContaminationReport:
    """What ``stats/report.html`` shows (:mod:`~refinery.transforms.decon.report_html`).

    Per eval dataset and n: the counts and the means of HELM's metrics over its rows; the
    training rows overlapping it at that n and the training files contributing most
    (:func:`top_train_files`); its most frequent overlapping n-grams (:func:`frequent_ngrams`);
    its ``examples`` most contaminated instances at that n (:func:`examples_at`), from the
    partitions' bounded samples. A text shared by several instances of the dataset is shown
    once, saying how many others have it. An instance without an id is named by its file and
    row (:func:`row_id`).
    """
    ns = sorted(set(ns))
    same = same_text(eval_rows)
    metrics: dict[tuple[str, int], list[dict[str, Any]]] = {(m["eval_dataset"], m["n"]): [] for m in result.metrics}
    for m in result.metrics:
        metrics[(m["eval_dataset"], m["n"])].append(m)
    per_n = {(s["eval_dataset"], s["n"]): s for s in result.overlap_stats}
    files = top_train_files(result)
    names = ("binary", "jaccard", "token", "jaccard_weighted", "token_weighted")
    by_ds: dict[str, list[EvalRow]] = defaultdict(list)
    for r in eval_rows:
        by_ds[r.eval_dataset].append(r)
    datasets = []
    for s in result.summary:
        ds = s["eval_dataset"]
        rows = by_ds[ds]
        results = []
        for k, n in enumerate(ns):
            ms = metrics.get((ds, n), [])
            mean = {key: sum(m[key] for m in ms) / len(ms) if ms else 0.0 for key in names}
            at_n = files.get((ds, n), [])
            contaminated = len(per_n[(ds, n)]["instance_ids"])
            results.append(rh.NResult(
                n, per_n[(ds, n)]["num_instances"], contaminated, binary=mean["binary"], jaccard=mean["jaccard"],
                token=mean["token"], jaccard_weighted=mean["jaccard_weighted"], token_weighted=mean["token_weighted"],
                train_rows=sum(f.train_rows for f in at_n), top_train_files=tuple(at_n),
                top_ngrams=tuple(frequent_ngrams(result, rows, n, same)) if contaminated else (),
                examples=tuple(examples_at(result, rows, ns, k, examples, same)) if contaminated else ()))
        datasets.append(rh.DatasetReport(ds, tuple(sorted({r.eval_path for r in rows})), s["num_rows"],
                                         s["num_instances"], s["num_empty_instances"], s["num_bad_rows"],
                                         tuple(results)))
    rows_read = (("eval rows", len(eval_rows)),
                 ("eval rows unreadable or without text", sum(s["num_bad_rows"] for s in result.summary)),
                 ("training rows", int(scan_stats.get("rows", 0))),
                 ("training rows unreadable or without text", int(scan_stats.get("bad_rows", 0))),
                 ("training rows with overlaps at any n (as scanned)", int(scan_stats.get("rows_with_hits", 0))),
                 *((f"training rows with overlaps at n = {n}", result.train_rows_at_n.get(n, 0)) for n in ns),
                 ("training text bytes", int(scan_stats.get("text_bytes", 0))))
    if result.capped:
        rows_read += (("detail records left out (over --max-ngram-details)", sum(c[3] - c[2] for c in result.capped)),)
    return rh.ContaminationReport("Train/test overlap report", settings, inputs, rows_read, tuple(datasets),
                                  "refinery decon")
