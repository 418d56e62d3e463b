"""HYDRA oracle labels: a harmony grading prompt, final-channel-only parsing of five 0-4 scores.

The oracle (a large gpt-oss) reads one document and answers, on the ``final`` channel, with
strict JSON ``{"helpfulness": h, "correctness": c, "coherence": o, "complexity": x,
"density": d}`` (integers 0-4). Parsing is defensive: harmony's parser (falling back to a
text scan, see :func:`refinery.transforms.formats.harmony.parse_final`) finds the final channel; the
first JSON object in it is read (code fences and surrounding prose tolerated); every failure
is recorded with its reason, never dropped.

``--constrained-json`` (constrained decoding, :func:`json_answer_choices`): the answer is forced
token by token to ``<|channel|>final<|message|>{"helpfulness": D, ...}<|return|>``; the model
chooses only each digit D among 0-4 (by its own logits), and writes no reasoning. It makes a
model that cannot write the JSON (the tiny random one of ``refinery tiny-checkpoint``) give
parseable labels; those labels are as good as the model, i.e. noise for a random one.

Outputs of ``refinery hydra oracle-label`` (merge): ``labels.jsonl`` (``{doc_id, scores}``,
parsed documents only), ``failures.jsonl`` (``{doc_id, error, final}``), ``summary.json``
(``documents, parsed, failed, unreadable, parse_rate``).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

from refinery.transforms.formats.harmony import RETURN_TOKEN, parse_final
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.inference.documents import JsonObject
from refinery.transforms.inference.handler import EngineSettings, GenerationParams
from refinery.transforms.inference.tasks import GenerateTask, HandlerOptions
from refinery.transforms.resumable import UnitContext

DIMENSIONS = ("helpfulness", "correctness", "coherence", "complexity", "density")

ORACLE_TEMPLATE = {
    "developer": (
        "You grade documents for a language-model training corpus. Rate the document the user "
        "gives on five dimensions, each an integer from 0 (worst) to 4 (best):\n"
        "- helpfulness: how useful it is to a reader who wants to learn something\n"
        "- correctness: factual and logical accuracy\n"
        "- coherence: clear structure and flow\n"
        "- complexity: depth of the ideas and reasoning\n"
        "- density: information per token (no boilerplate, spam or repetition)\n"
        "Answer in the final channel with strict JSON only, exactly these keys and no other text:\n"
        '{"helpfulness": 0, "correctness": 0, "coherence": 0, "complexity": 0, "density": 0}'
    ),
    "user": "Document:\n<<<\n{text}\n>>>",
}

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def _first_json_object(text: str) -> str | None:
    """The first balanced ``{...}`` in ``text`` (string-aware), or None."""
    start = text.find("{")
    while start != -1:
        depth, in_str, esc = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i + 1]
        start = text.find("{", start + 1)
    return None


def parse_scores(final: str | None) -> tuple[dict[str, float] | None, str | None]:
    """(scores, None) or (None, reason) for the oracle's final-channel text."""
    if final is None:
        return None, "no final channel in the output"
    text = final.strip()
    fenced = _FENCE.search(text)
    if fenced:
        text = fenced.group(1)
    blob = _first_json_object(text)
    if blob is None:
        return None, "no JSON object in the final channel"
    try:
        obj = json.loads(blob)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} at column {e.colno}"
    if not isinstance(obj, dict):
        return None, "JSON is not an object"
    lowered = {str(k).strip().lower(): v for k, v in obj.items()}
    missing = [d for d in DIMENSIONS if d not in lowered]
    if missing:
        return None, f"missing score(s): {', '.join(missing)}"
    scores = {}
    for d in DIMENSIONS:
        v = lowered[d]
        if isinstance(v, str):
            try:
                v = float(v.strip())
            except ValueError:
                return None, f"{d} is not a number: {lowered[d]!r}"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            return None, f"{d} is not a number: {lowered[d]!r}"
        if not 0 <= v <= 4:
            return None, f"{d} = {v} is outside 0..4"
        scores[d] = float(v)
    return scores, None


SCORE_DIGITS = "01234"


def json_answer_choices() -> tuple[tuple[int, ...], ...]:
    """The constrained oracle answer, one allowed-token set per generated token:
    ``<|channel|>final<|message|>{"helpfulness": D, "correctness": D, ...}<|return|>`` where
    every position is forced (one token) except each score D, one of the tokens ``0``..``4``."""
    enc = get_encoding()
    digits = tuple(enc.encode_single_token(d) for d in SCORE_DIGITS)
    steps: list[tuple[int, ...]] = [(t,) for t in enc.encode("<|channel|>final<|message|>", allowed_special="all")]
    for i, d in enumerate(DIMENSIONS):
        steps += [(t,) for t in enc.encode_ordinary(("{" if i == 0 else ", ") + f'"{d}": ')]
        steps.append(digits)
    steps += [(t,) for t in enc.encode_ordinary("}")]
    steps.append((RETURN_TOKEN,))
    return tuple(steps)


def parse_oracle_tokens(tokens: Sequence[int]) -> tuple[dict[str, float] | None, str | None, str | None]:
    """(scores, error, final text) for a completion's tokens: the final channel only."""
    final = parse_final(tokens)
    scores, error = parse_scores(final)
    return scores, error, final


class OracleTask(GenerateTask):
    """Grading prompts -> parsed scores (``labels.jsonl``, ``failures.jsonl``, ``summary.json``)."""

    name = "oracle"

    def __init__(self, engine: EngineSettings, params: GenerationParams, handler_options: HandlerOptions | None = None,
                 constrained_json: bool = False) -> None:
        if constrained_json:
            choices = json_answer_choices()
            if params.max_tokens < len(choices):
                raise ValueError(f"--constrained-json needs --max-tokens of at least {len(choices)} "
                                 f"(the tokens of the JSON answer), got {params.max_tokens}")
            params = replace(params, choices=choices)
        super().__init__(engine, params, "rephrase", handler_options)
        self.template = dict(ORACLE_TEMPLATE)
        self.template_name = "oracle"

    def record(self, doc_id: str, meta: JsonObject, inference: Mapping[str, Any]) -> JsonObject:
        scores, error, final = parse_oracle_tokens(inference["tokens"])
        return {"doc_id": doc_id, "scores": scores, "error": error,
                "final": final if error else None, "finish_reason": inference["finish_reason"],
                "prompt_tokens": inference["prompt_tokens"], "generated_tokens": inference["generated_tokens"],
                "truncated_tokens": meta["truncated_tokens"]}

    def merge(self, rows: Iterator[JsonObject], ctx: UnitContext) -> dict[str, float]:
        stats: dict[str, float] = {"documents": 0, "parsed": 0, "failed": 0, "unreadable": 0, "generated_tokens": 0}
        with ctx.open_write(ctx.output_path("labels.jsonl")) as labels, \
                ctx.open_write(ctx.output_path("failures.jsonl")) as failures:
            for row in rows:
                stats["documents"] += 1
                doc_id = row.get("doc_id", row.get("id"))
                if row.get("scores"):
                    labels.write(json.dumps({"doc_id": doc_id, "scores": row["scores"]}, ensure_ascii=False).encode()
                                 + b"\n")
                    stats["parsed"] += 1
                else:
                    unreadable = "scores" not in row  # the document itself could not be read
                    stats["unreadable" if unreadable else "failed"] += 1
                    failures.write(json.dumps({"doc_id": doc_id, "error": row.get("error"),
                                               "final": (row.get("final") or "")[:500]},
                                              ensure_ascii=False).encode() + b"\n")
                stats["generated_tokens"] += row.get("generated_tokens", 0)
        graded = stats["parsed"] + stats["failed"]
        stats["parse_rate"] = stats["parsed"] / graded if graded else 0.0
        ctx.write_bytes(ctx.output_path("summary.json"), json.dumps(stats, indent=1).encode())
        return stats
