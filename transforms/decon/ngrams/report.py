"""What the reports show: overlapping instances, report.md and the data of report.html."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterator

from refinery.transforms.decon import report_html as rh

from .index import EvalRow
from .reduce import SNIPPET_CONTEXT, SNIPPET_MAX_CHARS, ReduceResult, SameText, same_text


def overlap_instance(r: EvalRow) -> dict:
    """The line of ``overlap_instances.jsonl.gz`` for an eval row: its text, written once."""
    return {"eval_dataset": r.eval_dataset, "eval_path": r.eval_path, "eval_row": r.eval_row,
            "instance_id": r.instance_id, "eval_text": r.text}


def overlap_instances(eval_rows: list[EvalRow], overlaps: dict, same: SameText | None = None,
                      metrics: list[dict] | None = None) -> Iterator[dict]:
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
        if per_row:
            line["by_n"] = [{"n": m["n"], "longest_match": m["longest_match"], "coverage": m["coverage"]}
                            for m in metrics[r.eval_idx * per_row:(r.eval_idx + 1) * per_row]]
        if r.eval_idx in same.others:
            line["same_text"] = [{k: v for k, v in overlap_instance(eval_rows[i]).items() if k != "eval_text"}
                                 for i in same.others[r.eval_idx]]
        yield line


def capped_warning(capped: list, max_ngram_details: int | None) -> str:
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


def longest_examples(metrics: list[dict], top: int) -> list[dict]:
    """Per eval dataset (sorted), its ``top`` overlapping instances at the largest n, by
    longest match, then coverage, then eval order: the metrics rows (:attr:`ReduceResult.metrics`)."""
    if not metrics:
        return []
    n_max = max(m["n"] for m in metrics)
    by_ds: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for i, m in enumerate(metrics):
        if m["n"] == n_max and m["binary"]:
            by_ds[m["eval_dataset"]].append((i, m))
    out = []
    for ds in sorted(by_ds):
        ranked = sorted(by_ds[ds], key=lambda im: (-im[1]["longest_match"], -im[1]["coverage"], im[0]))
        out += [m for _, m in ranked[:top]]
    return out


def render_report(result: ReduceResult, scan_stats: dict, max_train_count: int | None, top: int = 5,
                  max_ngram_details: int | None = None) -> str:
    """A short human-readable report: per dataset and n, contamination and top files; then
    per dataset its ``top`` instances with the longest match at the largest n
    (:func:`longest_examples`)."""
    lines = ["# Train/test overlap report", ""]
    lines.append(f"training rows scanned: {scan_stats.get('rows', 0)}, "
                 f"text: {scan_stats.get('text_bytes', 0) / 1e6:.1f} MB, "
                 f"rows with overlaps: {scan_stats.get('rows_with_hits', 0)}")
    if max_train_count is not None:
        lines.append(f"n-grams ignored (in more than {max_train_count} training documents): {result.ignored_ngrams}")
    if result.capped:
        lines.append(f"detail records capped: {capped_warning(result.capped, max_ngram_details)}")
    lines.append("")
    summary = {s["eval_dataset"]: s for s in result.summary}
    top_files: dict[tuple[str, int], list] = defaultdict(list)
    for row in result.by_train_path:
        top_files[(row["eval_dataset"], row["n"])].append((row["num_instances"], row["train_path"]))
    lines.append("| eval_dataset | n | contaminated | instances | % | top training files (instances) |")
    lines.append("|---|---|---|---|---|---|")
    for s in result.overlap_stats:
        ds, n = s["eval_dataset"], s["n"]
        k, total = len(s["instance_ids"]), s["num_instances"]
        pct = 100.0 * k / total if total else 0.0
        files = sorted(top_files[(ds, n)], key=lambda x: (-x[0], x[1]))[:top]
        tops = ", ".join(f"{p} ({c})" for c, p in files) or "-"
        lines.append(f"| {ds} | {n} | {k} | {total} | {pct:.2f} | {tops} |")
    lines.append("")
    for ds, s in sorted(summary.items()):
        if s["num_empty_instances"] or s["num_bad_rows"]:
            lines.append(f"- {ds}: {s['num_empty_instances']} empty/punctuation-only instances (never counted "
                         f"as overlapping), {s['num_bad_rows']} unreadable rows or rows without text")
    examples = longest_examples(result.metrics, top)
    if examples:
        lines += ["", f"## Longest matches (n = {examples[0]['n']})", "",
                  "longest match: the longest run of eval tokens covered by the n-grams of one training row; "
                  "coverage: the share of the eval tokens covered by any overlapping n-gram (HELM's token metric).",
                  "", "| eval_dataset | instance_id | eval_row | longest match (tokens) | coverage |",
                  "|---|---|---|---|---|"]
        for m in examples:
            cell = str(m["instance_id"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {m['eval_dataset']} | {cell} | {m['eval_row']} | {m['longest_match']} | "
                         f"{m['coverage']:.4f} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class MergedSnippet:
    text: str
    spans: list[tuple[int, int]]   # offsets relative to ``text``
    cut_before: bool               # the training text goes on before ``text``
    cut_after: bool                # ... and (as far as the hits tell) after it


def merged_snippet(hits: list) -> MergedSnippet:
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
    return MergedSnippet(text, spans, lo > 0, goes_on)


def contamination_report(result: ReduceResult, eval_rows: list[EvalRow], ns: list[int], examples: int,
                         settings: tuple[tuple[str, str], ...], inputs: tuple[tuple[str, str, str], ...],
                         scan_stats: dict) -> rh.ContaminationReport:
    """What ``stats/report.html`` shows (:mod:`~refinery.transforms.decon.report_html`).

    Per eval dataset and n: the counts and the means of HELM's metrics over its rows; the
    training files contributing most (instances contaminated at any n); the ``examples``
    most contaminated instances at the largest n (HELM's token metric, ties in eval order),
    each with its overlapping spans and its first two training rows (scan order) as
    snippets, from the partitions' bounded samples. A text shared by several instances of
    the dataset is shown once, saying how many others have it.
    """
    ns = sorted(set(ns))
    same = same_text(eval_rows)
    metrics = {(m["eval_dataset"], m["n"]): [] for m in result.metrics}
    for m in result.metrics:
        metrics[(m["eval_dataset"], m["n"])].append(m)
    per_n = {(s["eval_dataset"], s["n"]): s for s in result.overlap_stats}
    files: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for row in result.by_train_path:
        files[row["eval_dataset"]][row["train_path"]].update(row["instance_ids"])
    at_max = {r.eval_idx: result.metrics[r.eval_idx * len(ns) + len(ns) - 1] for r in eval_rows}
    names = ("binary", "jaccard", "token", "jaccard_weighted", "token_weighted")
    datasets = []
    for s in result.summary:
        ds = s["eval_dataset"]
        rows = [r for r in eval_rows if r.eval_dataset == ds]
        results = []
        for n in ns:
            ms = metrics.get((ds, n), [])
            means = [sum(m[k] for m in ms) / len(ms) if ms else 0.0 for k in names]
            results.append(rh.NResult(n, per_n[(ds, n)]["num_instances"], len(per_n[(ds, n)]["instance_ids"]), *means))
        top = sorted(((p, len(ids)) for p, ids in files[ds].items()), key=lambda x: (-x[1], x[0]))
        ranked = sorted((r for r in rows if at_max[r.eval_idx]["binary"]),
                        key=lambda r: (-at_max[r.eval_idx].get("longest_match", 0), -at_max[r.eval_idx]["token"],
                                       r.eval_idx))
        copies = Counter(r.text for r in ranked)
        chosen: dict[str, EvalRow] = {}
        for r in ranked:
            if len(chosen) == examples:
                break
            chosen.setdefault(r.text, r)
        shown = []
        for r in chosen.values():
            hits = []
            for _, row, path, row_hits in result.samples.get(same.first_of(r.eval_idx), []):
                snippet = merged_snippet(row_hits)
                hits.append(rh.TrainHit(path, row, snippet.text, tuple(rh.Span(a, b) for a, b in snippet.spans),
                                        len({h[0] for h in row_hits}), snippet.cut_before, snippet.cut_after))
            shown.append(rh.Example(r.instance_id, r.eval_row, r.text,
                                    tuple(rh.Span(a, b) for a, b in result.spans.get(same.first_of(r.eval_idx), [])),
                                    at_max[r.eval_idx]["token"], tuple(hits), copies[r.text] - 1,
                                    at_max[r.eval_idx].get("longest_match", 0)))
        datasets.append(rh.DatasetReport(ds, tuple(sorted({r.eval_path for r in rows})), s["num_rows"],
                                         s["num_instances"], s["num_empty_instances"], s["num_bad_rows"],
                                         tuple(results), tuple(top), tuple(shown), ns[-1]))
    rows_read = (("eval rows", len(eval_rows)),
                 ("eval rows unreadable or without text", sum(s["num_bad_rows"] for s in result.summary)),
                 ("training rows", int(scan_stats.get("rows", 0))),
                 ("training rows unreadable or without text", int(scan_stats.get("bad_rows", 0))),
                 ("training rows with overlaps", int(scan_stats.get("rows_with_hits", 0))),
                 ("training text bytes", int(scan_stats.get("text_bytes", 0))))
    if result.capped:
        rows_read += (("detail records left out (over --max-ngram-details)", sum(c[3] - c[2] for c in result.capped)),)
    return rh.ContaminationReport("Train/test overlap report", settings, inputs, rows_read, tuple(datasets),
                                  "refinery decon")
