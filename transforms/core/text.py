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
import string
from typing import Any

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
