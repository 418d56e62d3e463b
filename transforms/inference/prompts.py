"""Prompts of ``refinery generate``: a built-in template or a text file with ``{text}``, and
a document fitted into the prompt's token budget (its tail cut)."""
from __future__ import annotations

from typing import Callable, Mapping

from refinery.transforms.formats.harmony import render_prompt
from refinery.transforms.inference.documents import Doc
from refinery.transforms.inference.handler import decode
from refinery.transforms.io import storage

TEMPLATES: dict[str, dict[str, str | None]] = {
    "rephrase": {
        "developer": "Rephrase the document the user gives you as clear, well-structured prose. Keep every "
                     "fact, number and name; add nothing new. Answer with the rephrased document only.",
        "user": "{text}",
    },
}


def load_template(name_or_path: str) -> dict[str, str | None]:
    """A built-in template name, or a text file whose ``{text}`` marks where the document goes
    (the whole file is the user message)."""
    if name_or_path in TEMPLATES:
        return dict(TEMPLATES[name_or_path])
    try:
        text = storage.read_bytes(name_or_path).decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"template {name_or_path!r}: not a built-in ({', '.join(TEMPLATES)}) "
                         f"and no such file") from None
    if "{text}" not in text:
        raise ValueError(f"template file {name_or_path}: has no {{text}} placeholder")
    return {"developer": None, "user": text}


def fit_prompt(render: Callable[[str], list[int]], doc: Doc, budget: int) -> tuple[list[int], str, int]:
    """(prompt tokens, document text used, tokens cut): the document's tail is cut until the
    rendered prompt fits in ``budget`` tokens (the assistant-start suffix always stays)."""
    text = doc.get_text()
    prompt = render(text)
    if len(prompt) <= budget:
        return prompt, text, 0
    tokens = doc.get_tokens()
    keep = max(0, len(tokens) - (len(prompt) - budget))
    while True:
        text = decode(tokens[:keep])
        prompt = render(text)
        if len(prompt) <= budget or keep == 0:
            break
        keep = max(0, keep - max(1, len(prompt) - budget))
    if len(prompt) > budget:
        raise ValueError(f"doc {doc.id}: the template alone takes {len(prompt)} tokens, over the budget {budget}")
    return prompt, text, len(tokens) - keep


def render_template(template: Mapping[str, str | None], text: str) -> list[int]:
    return render_prompt(developer=template.get("developer"), user=template_user(template).replace("{text}", text))


def template_user(template: Mapping[str, str | None]) -> str:
    """The template's user message (``{text}`` where the document goes)."""
    user = template["user"]
    assert user is not None  # load_template: every template has one
    return user
