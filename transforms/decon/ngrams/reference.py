"""A straightforward pure-Python implementation of the method (the HELM shape: a dict of test
n-grams, stream the training rows), for tests and ``bench/decon.py``."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from .index import EvalRow
from .normalized import match_text
from .word_split import WordSplitter, effective_lengths, iter_ngrams


def reference_overlap(eval_rows: list[EvalRow], train: Iterable[tuple[str, int, str]], ns: list[int],
                      tokenizer: WordSplitter) -> tuple[dict[tuple[str, int], list[str]], set[Any]]:
    """Straightforward implementation of the same method.

    ``train`` yields ``(train_path, train_row, text)``. Both sides' texts are normalized and
    folded first (:func:`.normalized.match_text`: the text prep trains on, folded with the
    tokenizer's match fold, as decon does). Returns (instance ids per
    (dataset, configured n), sorted; the set of detail keys
    ``(eval_idx, train_path, train_row, effective n, ngram)``).
    """
    ns = sorted(set(ns))
    index: dict[tuple[int, str], list[EvalRow]] = {}
    for r in eval_rows:
        tokens = tokenizer.tokenize(match_text(tokenizer, r.text))
        for length in effective_lengths(ns, len(tokens)):
            for _, gram in iter_ngrams(tokens, length):
                bucket = index.setdefault((length, gram), [])
                if not bucket or bucket[-1] is not r:
                    bucket.append(r)
    lengths = sorted({k[0] for k in index})
    found: dict[tuple[str, int], set[Any]] = defaultdict(set)
    details: set[Any] = set()
    for path, row, text in train:
        tokens = tokenizer.tokenize(match_text(tokenizer, text))
        for length in lengths:
            for i in range(len(tokens) - length + 1):
                gram = " ".join(tokens[i:i + length])
                rows = index.get((length, gram))
                if rows:
                    for r in rows:
                        details.add((r.eval_idx, path, row, length, gram))
                        for n in ns:
                            if min(n, r.num_tokens) == length:
                                found[(r.eval_dataset, n)].add(r.instance_id)
    datasets = sorted({r.eval_dataset for r in eval_rows})
    return {(ds, n): sorted(found[(ds, n)]) for ds in datasets for n in ns}, details
