"""The text of a row: one field, or a template over several fields; chat message lists flattened.

One implementation for every command that reads document text from rows (prep's normalize
step, decon's eval rows and training scan, and their public PTransforms)::

    spec = TextSpec(field="text")                          # --text-field text (the default)
    spec = TextSpec(template="{question}\\n\\n{answer}")     # --text-template '{question}\\n\\n{answer}'
    text, reason = spec.extract(record)                    # (text, None) or (None, why not)

Rules:

- **Field**: ``record[field]`` must be a string, or a chat message list (below).
- **Template**: Python format syntax over the row's top-level keys: ``{name}`` is replaced by
  the value of ``record[name]`` (a string, or a chat message list, flattened); ``{{`` and
  ``}}`` are literal braces. Only plain names: no attribute or index access (``{a.b}``,
  ``{a[0]}``), no conversion (``!r``) or format spec (``:>10``), no positional ``{}``; at
  least one field. :func:`parse_template` says what is wrong with one, in one line.
- **Chat rows**: a list whose first element is a dict is a list of messages, each a dict
  with string ``role`` and ``content`` (other keys are ignored). It is flattened to
  ``"{role}: {content}"`` per message, joined by a blank line (:data:`CHAT_SEPARATOR`)::

      [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
      -> "user: Hi\\n\\nassistant: Hello"

  A malformed element (not a dict, no role or content, a role or content that is not a
  string, e.g. ``null`` or a list of content parts) makes the row a reject naming the field
  and the element's index. Any other list (of strings, or empty) is "list, not a string".
- **Reasons** (the row is a reject): ``missing text field 'text'``, ``text field 'text' is
  int, not a string``; with a template, ``missing field 'answer' (text template)``,
  ``field 'answer' is int, not a string (text template)``.
- **Command lines** (:func:`unescape`): in a ``--text-template`` the two characters ``\\n``
  are a newline, ``\\t`` a tab and ``\\\\`` one backslash (what a user types inside bash
  single quotes); any other backslash is an error.

The text is returned as built, before any normalization (prep normalizes it afterwards).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import string
import unicodedata
from typing import Any, Literal

import numpy as np

CHAT_SEPARATOR = "\n\n"  # between messages, each written "{role}: {content}"
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_TEMPLATE = " (text template)"


class TemplateError(ValueError):
    """A text template that cannot be used; the message is one line saying why."""


def unescape(text: str) -> str:
    """A template as typed on a command line -> the template: ``\\n`` newline, ``\\t`` tab,
    ``\\\\`` backslash. Any other backslash raises :class:`TemplateError`."""
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            nxt = text[i + 1: i + 2]
            if nxt not in _ESCAPES:
                shown = "a trailing '\\'" if not nxt else f"'\\{nxt}'"
                raise TemplateError(f"{shown} is not an escape it knows: use \\n (newline), \\t (tab) or "
                                    f"\\\\ (a backslash)")
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def escape(template: str) -> str:
    """A template as one would type it (the inverse of :func:`unescape`): for one-line displays."""
    return template.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def parse_template(template: str) -> tuple[tuple[str, str | None], ...]:
    """``(literal text, field name or None)`` pairs of a template, in order; raises
    :class:`TemplateError` (one line) for anything but plain ``{name}`` fields."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # unbalanced braces
        raise TemplateError(f"{template!r} is not a valid template: {e} (write {{{{ and }}}} for literal braces)"
                            ) from None
    parts: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is not None:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            where = f"{template!r}: field {{{shown}}}"
            if not name:
                raise TemplateError(f"{template!r}: an empty {{}} field; name a field of the rows, e.g. {{text}}")
            if any(c in name for c in ".[]{}"):
                raise TemplateError(f"{where}: only plain field names (no attribute or index access)")
            if conversion or spec:
                raise TemplateError(f"{where}: conversions (!r) and format specs (:...) are not supported")
        parts.append((literal, name))
    if not any(name for _, name in parts):
        raise TemplateError(f"{template!r} names no field; use e.g. '{{question}}\\n\\n{{answer}}'")
    return tuple(parts)


def flatten_chat(messages: list[Any], label: str, suffix: str = "") -> tuple[str | None, str | None]:
    """(text, None) of a message list, or (None, reason naming ``label`` and the element)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return None, f"{label} message {i} is {type(m).__name__}, not a dict with role and content{suffix}"
        for key in ("role", "content"):
            if key not in m:
                return None, f"{label} message {i} has no {key!r}{suffix}"
            if not isinstance(m[key], str):
                return None, f"{label} message {i} {key!r} is {type(m[key]).__name__}, not a string{suffix}"
        out.append(f"{m['role']}: {m['content']}")
    return CHAT_SEPARATOR.join(out), None


def _is_chat(value: object) -> bool:
    return type(value) is list and bool(value) and isinstance(value[0], dict)


_MISSING = object()


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """Where a row's text comes from: exactly one of ``field`` (a top-level key) or
    ``template`` (format syntax over top-level keys; real newlines, not escapes: see
    :func:`unescape`). Hashable and picklable; construction validates the template."""

    field: str | None = None
    template: str | None = None
    _parts: tuple[Any, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.field is None) == (self.template is None):
            raise ValueError("TextSpec: give exactly one of field or template")
        if self.template is not None:
            object.__setattr__(self, "_parts", parse_template(self.template))
        elif not isinstance(self.field, str) or not self.field:
            raise ValueError(f"TextSpec: the text field must be a non-empty string, not {self.field!r}")

    @classmethod
    def of(cls, text: str | TextSpec) -> TextSpec:
        """A field name or a spec -> a spec."""
        return text if isinstance(text, TextSpec) else cls(field=text)

    @classmethod
    def from_options(cls, field: str | None, template: str | None, default_field: str = "text") -> TextSpec:
        """The spec of a ``text_field`` / ``text_template`` pair of options (at most one set)."""
        if field is not None and template is not None:
            raise ValueError("give a text field or a text template, not both")
        return cls(template=template) if template is not None else cls(field=default_field if field is None else field)

    def fields(self) -> tuple[str, ...]:
        """The top-level keys the text is made of (the columns a parquet read needs), in order."""
        if self.field is not None:
            return (self.field,)
        return tuple(dict.fromkeys(name for _, name in self._parts if name))

    def identity(self) -> dict[str, Any]:
        """What a stage config records: ``{"text_field": F}`` (as before templates existed, so
        the hashes of outputs made with a text field do not change) or ``{"text_template": T}``."""
        return {"text_field": self.field} if self.template is None else {"text_template": self.template}

    def describe(self) -> tuple[str, str]:
        """(what, value) for reports: ``("text field", "question")`` or ``("text template", T)``,
        T on one line, as typed (:func:`escape`)."""
        if self.field is not None:
            return ("text field", self.field)
        return ("text template", escape(self.template or ""))

    def extract(self, record: object) -> tuple[str | None, str | None]:
        """(text, None) or (None, reason) of a parsed row (a reason names the field)."""
        if not isinstance(record, dict):
            return None, f"not a row: a {type(record).__name__}, expected a JSON object"
        if self.field is not None:
            name = self.field
            value = record.get(name, _MISSING)
            if isinstance(value, str):
                return value, None
            if value is _MISSING:
                return None, f"missing text field {name!r}"
            if _is_chat(value):
                return flatten_chat(value, f"text field {name!r}")
            return None, f"text field {name!r} is {type(value).__name__}, not a string"
        out = []
        for literal, name in self._parts:
            out.append(literal)
            if name is None:
                continue
            value = record.get(name, _MISSING)
            if not isinstance(value, str):
                if value is _MISSING:
                    return None, f"missing field {name!r}{_TEMPLATE}"
                if not _is_chat(value):
                    return None, f"field {name!r} is {type(value).__name__}, not a string{_TEMPLATE}"
                value, error = flatten_chat(value, f"field {name!r}", _TEMPLATE)
                if error is not None:
                    return None, error
            out.append(value)
        return "".join(out), None


# ---------------------------------------------------------------------------------------
# Normalization: the text prep trains on, and decon n-grams (one function, shared)
# ---------------------------------------------------------------------------------------

#: The version of :func:`normalize_text`, recorded where an output depends on it (decon's
#: stage configs, its drop lists' ``train_files.jsonl``): a change of the rule is a new
#: version, so outputs are recomputed and a drop list of another version is refused.
#: (``nfc-cc-strip-1`` applied NFC before dropping controls: ``"e\x81\u0301"`` became
#: ``"e\u0301"``, not NFC, so the rule was not its own fixed point.)
TEXT_NORMALIZATION = "cc-nfc-strip-2"

# Every Cc code point (C0, DEL, C1) except \t and \n is dropped. \r is handled first.
_CC_TO_DROP = re.compile("[" + "".join(re.escape(chr(cp)) for cp in range(0xA0)  # every Cc lies below U+00A0
                                      if unicodedata.category(chr(cp)) == "Cc" and chr(cp) not in "\t\n") + "]")
_ASCII_CLEAN = b"\t\n" + bytes(range(0x20, 0x7F))  # ASCII that needs no fixing
Form = Literal["NFC", "NFKC"]  # the composed normalization forms an offset map follows


def normalize_text(text: str) -> str:
    """The normalized form of a document's text ('' means the document is empty), in this
    order (:data:`TEXT_NORMALIZATION`): ``\\r\\n`` and ``\\r`` become ``\\n``; Unicode Cc
    characters are dropped except ``\\n`` and ``\\t``; NFC; leading/trailing whitespace
    stripped. Its own fixed point: ``normalize_text(normalize_text(t)) == normalize_text(t)``
    (NFC makes no control, and what a strip leaves of an NFC text is NFC). NFC comes after
    the controls are dropped: a mark a control kept apart from its base (``"e\\x81\\u0301"``)
    is composed with it, as a second pass would."""
    ascii = text.isascii()
    if ascii and not text.encode("ascii").translate(None, _ASCII_CLEAN):  # the common case: nothing to fix
        return text.strip()
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if _CC_TO_DROP.search(text) is not None:  # a search is ~15x cheaper than translate()
        text = _CC_TO_DROP.sub("", text)
    if not ascii and not unicodedata.is_normalized("NFC", text):  # (ASCII is NFC)
        text = unicodedata.normalize("NFC", text)
    return text.strip()


@functools.lru_cache(maxsize=2)
def _unstable_run(form: Form) -> re.Pattern[str]:
    """A run the normalization ``form`` (NFC or NFKC) may change as a whole: an optional first
    character, then one or more characters that are not a normalization boundary (a combining
    mark, a character ``form`` changes by itself, or one that may compose with the character
    before it: the second character of a canonical pair, a Hangul vowel or trailing
    consonant). Every other character is a boundary: ``form`` leaves it as it is, and nothing
    before it reaches past it."""
    unsafe = set(range(0x1160, 0x1200)) | set(range(0xD7B0, 0xD800))  # Hangul jungseong, jongseong
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        c = chr(cp)
        if unicodedata.combining(c):
            unsafe.add(cp)
        if form != "NFC" and unicodedata.normalize(form, c) != c:  # a compatibility form
            unsafe.add(cp)
        canonical = unicodedata.decomposition(c)
        if canonical and canonical[0] != "<":
            if unicodedata.normalize("NFC", c) != c:
                unsafe.add(cp)
            parts = canonical.split()
            if len(parts) == 2:
                unsafe.add(int(parts[1], 16))
    ranges: list[list[int]] = []
    for cp in sorted(unsafe):
        if ranges and cp == ranges[-1][1] + 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    body = "".join(re.escape(chr(a)) + ("" if a == b else "-" + re.escape(chr(b))) for a, b in ranges)
    return re.compile(f"[^{body}]?[{body}]+")


def _segments(text: str, a: int, b: int, form: Form) -> list[tuple[int, int]]:
    """``text[a:b]`` (a run of :func:`_unstable_run`) cut into the smallest pieces ``form``
    normalizes apart: each starter (combining class 0) with the marks after it, joined to the
    piece before it where ``form`` of the two together differs from ``form`` of each (a
    composition)."""
    def apart(lo: int, mid: int, hi: int) -> bool:
        nf = unicodedata.normalize
        return nf(form, text[lo:hi]) == nf(form, text[lo:mid]) + nf(form, text[mid:hi])

    cuts = [i for i in range(a + 1, b) if not unicodedata.combining(text[i])]
    out: list[tuple[int, int]] = []
    for lo, hi in zip([a, *cuts], [*cuts, b]):
        out.append((lo, hi))
        # a piece joined to the one before may now reach the one before that (a mark NFC moves)
        while len(out) > 1 and not apart(out[-2][0], out[-1][0], out[-1][1]):
            out[-2:] = [(out[-2][0], out[-1][1])]
    return out


def _identity_map(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(lo, hi, dtype=np.int64), np.arange(lo + 1, hi + 1, dtype=np.int64)


def composed_offsets(text: str, form: Form = "NFC") -> tuple[str, np.ndarray, np.ndarray]:
    """``(unicodedata.normalize(form, text), start, end)``, ``form`` NFC or NFKC: each code
    point ``i`` of the result comes from ``text[start[i]:end[i]]`` (int64 arrays). A character
    ``form`` leaves alone comes from itself; a run it composes, reorders or expands (a starter
    and its combining marks, a ligature) comes from the whole run, each of its output
    characters; where the run's starter normalizes by itself and only marks after it change,
    the starter's output comes from it and the rest from the marks."""
    n = len(text)
    if unicodedata.is_normalized(form, text):
        return (text, *_identity_map(0, n))
    pieces, starts, ends, at = [], [], [], 0
    for m in _unstable_run(form).finditer(text):
        a, b = m.span()
        if a > at:
            pieces.append(text[at:a])
            s, e = _identity_map(at, a)
            starts.append(s)
            ends.append(e)
        for lo, hi in _segments(text, a, b, form):
            piece = text[lo:hi]
            out = unicodedata.normalize(form, piece)
            pieces.append(out)
            head = unicodedata.normalize(form, piece[0])
            if out == piece:  # no change: each character from itself
                s, e = _identity_map(lo, hi)
            elif out == head + unicodedata.normalize(form, piece[1:]):
                # the starter maps by itself (a mark after it changed): from itself, the rest from the marks
                k = len(head)
                s = np.concatenate([np.full(k, lo, dtype=np.int64), np.full(len(out) - k, lo + 1, dtype=np.int64)])
                e = np.concatenate([np.full(k, lo + 1, dtype=np.int64), np.full(len(out) - k, hi, dtype=np.int64)])
            else:
                s, e = np.full(len(out), lo, dtype=np.int64), np.full(len(out), hi, dtype=np.int64)
            starts.append(s)
            ends.append(e)
        at = b
    pieces.append(text[at:])
    s, e = _identity_map(at, n)
    starts.append(s)
    ends.append(e)
    out = "".join(pieces)
    if out != unicodedata.normalize(form, text):  # pragma: no cover - a boundary the table missed
        out = unicodedata.normalize(form, text)  # every character then comes from the whole text
        return out, np.zeros(len(out), dtype=np.int64), np.full(len(out), n, dtype=np.int64)
    return out, np.concatenate(starts), np.concatenate(ends)


def kept_offsets(text: str, keep: np.ndarray, cps: np.ndarray | None = None) -> tuple[str, np.ndarray, np.ndarray]:
    """``(the characters of text where keep, start, end)``: each kept character from itself
    (``cps``: the text's code points, or what each becomes, one for one)."""
    if cps is None:
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    at = np.flatnonzero(keep)
    out = cps[at].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
    return out, at.astype(np.int64), at.astype(np.int64) + 1


def _control_offsets(text: str) -> tuple[str, np.ndarray, np.ndarray]:
    """``(text, start, end)`` after the control rule of :func:`normalize_text`: ``\\r\\n`` and
    ``\\r`` as ``\\n`` (the ``\\n`` of a ``\\r\\n`` from both), Cc but ``\\t`` ``\\n`` dropped."""
    if _CC_TO_DROP.search(text) is None:  # (\r is one of them)
        return (text, *_identity_map(0, len(text)))
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").copy()
    cr = np.flatnonzero(cps == 0x0D)
    pair = cr[cr + 1 < len(cps)]
    pair = pair[cps[pair + 1] == 0x0A]
    keep = ~(((cps < 0x20) & (cps != 0x09) & (cps != 0x0A) & (cps != 0x0D)) | ((cps >= 0x7F) & (cps < 0xA0)))
    keep[pair + 1] = False
    cps[cps == 0x0D] = 0x0A  # a \r\n pair is its \r by now
    out, start, end = kept_offsets(text, keep, cps)
    end[np.searchsorted(start, pair)] += 1  # the \n of \r\n comes from both
    return out, start, end


def then(start: np.ndarray, end: np.ndarray, later: tuple[str, np.ndarray, np.ndarray]
         ) -> tuple[str, np.ndarray, np.ndarray]:
    """Two offset maps one after the other: ``later`` maps a text whose characters come from
    ``[start, end)`` of an earlier one; each character of ``later``'s text then comes from the
    earlier text's ``[start[s], end[e - 1])`` (a step's spans are contiguous)."""
    out, s, e = later
    return out, start[s], end[e - 1]


def stripped_offsets(text: str, start: np.ndarray, end: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    """``(text.strip(), start, end)`` of a mapped text: its ends' whitespace comes from nothing."""
    lead = len(text) - len(text.lstrip())
    out = text.strip()
    return out, start[lead:lead + len(out)], end[lead:lead + len(out)]


def normalized_offsets(text: str) -> tuple[str, np.ndarray, np.ndarray]:
    """``(normalize_text(text), start, end)``: each code point ``i`` of the normalized text
    comes from ``text[start[i]:end[i]]`` (int64 arrays), through each step of the rule in
    turn: the control rule (a ``\\n`` made of ``\\r\\n`` from both; dropped controls from
    nothing), NFC (:func:`composed_offsets`: a run it composes or reorders from the whole run,
    a control dropped inside it included), the strip (the ends from nothing). So a span
    ``[s, e)`` of the normalized text maps to ``text[start[s]:end[e - 1]]`` (:func:`raw_spans`),
    whose normalization (but the strip) is ``normalized[s:e]``."""
    cleaned, start, end = _control_offsets(text)
    return stripped_offsets(*then(start, end, composed_offsets(cleaned)))


def raw_spans(start: np.ndarray, end: np.ndarray, span_start: np.ndarray, span_end: np.ndarray,
              raw_length: int) -> tuple[np.ndarray, np.ndarray]:
    """``[span_start, span_end)`` spans of a normalized text -> spans of the text it came from
    (``start``, ``end``: :func:`normalized_offsets`): from the raw start of the span's first
    character to the raw end of its last. An empty span sits where the character at it
    starts (at the text's end: after its last character; ``raw_length`` for an empty text
    whose raw form is all whitespace or controls, where nothing maps)."""
    m = len(start)
    at = np.append(start, end[-1] if m else raw_length)  # where position p starts, p in 0..m
    after = np.append(at[0] if m else raw_length, end)   # where the character before position p ends
    s = at[span_start]
    e = np.where(span_end > span_start, after[span_end], s)
    return s, e


# ---------------------------------------------------------------------------------------
# The match key: the text decon compares (decon only: prep trains on normalize_text's text)
# ---------------------------------------------------------------------------------------

#: decon's match folds (``refinery decon --match-fold``), applied to the normalized text of
#: both sides before n-gram matching. ``nfkc-cf`` (the default) drops the format characters
#: (Unicode Cf: soft hyphen U+00AD, zero-width space, joiners and direction marks
#: U+200B-U+200F, word joiner U+2060, BOM U+FEFF, ...), applies NFKC (fullwidth ``Ａ`` as
#: ``A``, the ligature ``ﬁ`` as ``fi``, ``²`` as ``2``, ...) and strips the ends: text that
#: is the same to a reader, or to a tokenizer that applies NFKC, is the same to the matcher.
#: ``none``: the normalized text as it is (HELM's text, the behaviour before the fold).
MATCH_FOLDS = ("nfkc-cf", "none")
DEFAULT_MATCH_FOLD = "nfkc-cf"


_CF, _MAPPED = 1, 2  # bits of _fold_tables()[0]


@functools.lru_cache(maxsize=1)
def _fold_tables() -> tuple[np.ndarray, np.ndarray]:
    """(uint8 flags, uint32 map), both indexed by code point: ``_CF`` for a format character
    (Unicode Cf); ``_MAPPED`` for one whose NFKC is one other code point, ``map`` then holding
    it (else the code point itself). Replacing a character by its NFKC never changes the NFKC
    of a text it is in (both have one NFKD), so the map is applied to a whole text at once
    and NFKC is left the rest (a ligature, a run that composes): fullwidth text costs a
    lookup, not CPython's full NFKC (~5 M characters a second)."""
    flags = np.zeros(0x110000, dtype=np.uint8)
    mapped = np.arange(0x110000, dtype=np.uint32)
    for cp in range(0x110000):
        c = chr(cp)
        if unicodedata.category(c) == "Cf":
            flags[cp] = _CF
            continue
        if 0xD800 <= cp < 0xE000:
            continue
        key = unicodedata.normalize("NFKC", c)
        if len(key) == 1 and key != c:
            flags[cp] = _MAPPED
            mapped[cp] = ord(key)
    return flags, mapped


def _check_fold(fold: str) -> None:
    if fold not in MATCH_FOLDS:
        raise ValueError(f"unknown match fold {fold!r}; choose one of {', '.join(MATCH_FOLDS)}")


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def _text_of(cps: np.ndarray) -> str:
    return cps.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


def _fold_flagged(text: str, cps: np.ndarray, flags: np.ndarray, seen: int) -> str:
    """The key of a non-ASCII ``text`` (code points ``cps``, their flags ``flags``, or-ed ``seen``)."""
    if seen:
        if seen & _CF:
            cps = cps[(flags & _CF) == 0]
        text = _text_of(_fold_tables()[1][cps] if seen & _MAPPED else cps)
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return text.strip()


def fold_text(text: str, fold: str) -> str:
    """The match key of a normalized text (:func:`normalize_text`) under ``fold``
    (:data:`MATCH_FOLDS`): ``nfkc-cf``: format characters (Cf) dropped, then NFKC, then the
    ends stripped; ``none``: the text as it is. ASCII text is its own key (no Cf; NFKC leaves
    it alone): that case costs one ``isascii``; other text one table lookup per character
    (:func:`_fold_tables`), and NFKC only where a character needs more than the table. A
    fixed point, as :func:`normalize_text` is. Many texts at once: :func:`fold_texts`."""
    if fold == "none" or text.isascii():
        if fold != "none" and fold != DEFAULT_MATCH_FOLD:
            _check_fold(fold)
        return text
    _check_fold(fold)
    cps = _code_points(text)
    flags = _fold_tables()[0][cps]
    return _fold_flagged(text, cps, flags, int(np.bitwise_or.reduce(flags)))


def fold_texts(texts: list[str], fold: str) -> list[str]:
    """``[fold_text(t, fold) for t in texts]``, the non-ASCII texts (a scan batch's) folded
    together: the table looked up, the format characters dropped and the one-to-one map
    applied for all of them at once, each text then cut out of the result; a text the table
    does not flag is kept as it is; NFKC's own check, and NFKC where it fails, a text at a
    time."""
    _check_fold(fold)
    at = [i for i, t in enumerate(texts) if not t.isascii()] if fold != "none" else []
    if not at:
        return texts
    table, mapped = _fold_tables()
    lengths = np.array([len(texts[i]) for i in at], dtype=np.int64)  # (each at least 1: not ASCII)
    firsts = np.zeros(len(at), dtype=np.int64)
    np.cumsum(lengths[:-1], out=firsts[1:])
    cps = _code_points("".join(texts[i] for i in at))
    flags = table[cps]
    seen = np.bitwise_or.reduceat(flags, firsts) != 0
    folded, cuts = "", [0]
    if seen.any():  # drop and map for the flagged texts at once; a text's own cut of the result
        inside = np.repeat(seen, lengths)
        cps, flags = cps[inside], flags[inside]
        keep = (flags & _CF) == 0
        folded = _text_of(np.where(flags & _MAPPED, mapped[cps], cps)[keep])
        at_first = np.zeros(int(seen.sum()), dtype=np.int64)
        np.cumsum(lengths[seen][:-1], out=at_first[1:])
        cuts = [0, *np.cumsum(np.add.reduceat(keep.astype(np.int64), at_first)).tolist()]
    out, j = list(texts), 0
    for i, flagged in zip(at, seen.tolist()):
        text = texts[i]
        if flagged:
            text, j = folded[cuts[j]:cuts[j + 1]], j + 1
        if not unicodedata.is_normalized("NFKC", text):
            text = unicodedata.normalize("NFKC", text)
        out[i] = text.strip()  # (the same object where there is nothing to strip)
    return out


def folded_offsets(text: str, fold: str) -> tuple[str, np.ndarray, np.ndarray]:
    """``(fold_text(text, fold), start, end)``: each code point ``i`` of the key comes from
    ``text[start[i]:end[i]]``, as :func:`normalized_offsets` maps a normalized text: dropped
    format characters from nothing (one between a base and its mark: in the run NFKC
    composes), a character the table maps to one other (fullwidth ``Ａ``) from itself, a
    character NFKC expands (a ligature) each of its output characters from it, a run it
    composes from the whole run, stripped ends from nothing."""
    _check_fold(fold)
    if fold == "none" or text.isascii():
        return (text, *_identity_map(0, len(text)))
    table, mapped = _fold_tables()
    cps = _code_points(text)
    flags = table[cps]
    keep = (flags & _CF) == 0
    cps = np.where(flags & _MAPPED, mapped[cps], cps)  # one to one: each from itself
    dropped, start, end = kept_offsets(text, keep, cps)
    return stripped_offsets(*then(start, end, composed_offsets(dropped, "NFKC")))
