"""Harmony conversations for gpt-oss, offline: prompts rendered to tokens, the final channel
parsed back (the engine in :mod:`refinery.kernels` only sees token ids).

``openai-harmony`` loads the o200k vocab from ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken``
when that variable is set, else downloads it. :func:`harmony_encoding` points it at a folder
holding the project's verified vocab (``refinery.transforms.formats.tiktoken_vocab.write_vocab_file``), so
nothing touches the network.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from refinery.transforms.formats.tiktoken_vocab import VOCAB_SHA256, user_cache_dir, write_vocab_file

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message

RETURN_TOKEN = 200002  # <|return|>
CALL_TOKEN = 200012  # <|call|>
STOP_TOKENS: tuple[int, ...] = (RETURN_TOKEN, CALL_TOKEN)

_ENV = "TIKTOKEN_ENCODINGS_BASE"


def _vocab_dir() -> Path:
    """A folder holding the verified ``o200k_base.tiktoken`` (written on first use)."""

    current = os.environ.get(_ENV)
    if current:
        existing = Path(current) / "o200k_base.tiktoken"
        if existing.exists() and hashlib.sha256(existing.read_bytes()).hexdigest() == VOCAB_SHA256:
            return Path(current)

    folder = Path(os.environ.get("REFINERY_HARMONY_VOCAB_DIR") or user_cache_dir("harmony-vocab"))
    folder.mkdir(parents=True, exist_ok=True)
    write_vocab_file(folder)
    return folder


@functools.lru_cache(maxsize=1)
def harmony_encoding() -> HarmonyEncoding:
    """openai-harmony's ``HARMONY_GPT_OSS`` encoding, loaded from the local vocab."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    os.environ[_ENV] = str(_vocab_dir())
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def stop_tokens() -> list[int]:
    """``<|return|>`` and ``<|call|>``: where an assistant turn ends."""
    return list(harmony_encoding().stop_tokens_for_assistant_actions())


def render_prompt(
    messages: Sequence[Mapping[str, str]] | None = None,
    *,
    system: str | None = None,
    developer: str | None = None,
    user: str | None = None,
    reasoning_effort: str = "low",
) -> list[int]:
    """Tokens of a conversation ready for the assistant's reply.

    ``messages`` are ``{"role": "system"|"developer"|"user"|"assistant", "content": str}``;
    the ``system``/``developer``/``user`` keywords append one message each, in that order.
    A system text becomes the model identity of harmony's system message (which always holds
    the reasoning effort and the valid channels); developer text becomes its instructions;
    assistant messages are rendered on the ``final`` channel.
    """
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
    )

    items = list(messages or [])
    for role, text in (("system", system), ("developer", developer), ("user", user)):
        if text is not None:
            items.append({"role": role, "content": text})
    effort = ReasoningEffort(reasoning_effort.capitalize())
    system_content = SystemContent.new().with_reasoning_effort(effort)
    rendered: list[Any] = []
    for item in items:
        role, content = item["role"], item["content"]
        if role == "system":
            system_content = system_content.with_model_identity(content)
        elif role == "developer":
            rendered.append(
                Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(content))
            )
        elif role == "user":
            rendered.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            rendered.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        else:
            raise ValueError(f"unknown role {role!r}")
    conversation = Conversation.from_messages(
        [Message.from_role_and_content(Role.SYSTEM, system_content), *rendered]
    )
    encoding = harmony_encoding()
    return list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))


def _message_text(message: Message) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


_SPECIAL = re.compile(r"<\|[a-z_]+\|>")
_FINAL = re.compile(r"<\|channel\|>\s*final\b[^<]*<\|message\|>(.*?)(?:<\|(?:end|return|call)\|>|$)", re.S)


def parse_final(tokens: Iterable[int]) -> str | None:
    """The text of the assistant's ``final`` channel in completion ``tokens``, else None.

    Defensive: harmony's streaming parser first (a truncated final message still counts);
    if it finds nothing or fails on a malformed header, a plain-text scan of the decoded
    tokens; a completion with no channel markup at all (e.g. a bare refusal) is returned
    whole, special tokens removed.
    """
    from openai_harmony import Role, StreamableParser

    tokens = [int(t) for t in tokens]
    encoding = harmony_encoding()
    finals: list[str] = []
    parser = StreamableParser(encoding, role=Role.ASSISTANT, strict=False)
    try:
        for token in tokens:
            parser.process(token)
        finals = [_message_text(m) for m in parser.messages if m.channel == "final"]
        if parser.current_channel == "final" and parser.current_content:
            finals.append(parser.current_content)  # truncated before <|return|>
    except Exception:  # malformed output: fall back to the text scan
        finals = []
    if finals:
        return finals[-1]
    text = encoding.decode(tokens)
    matches: list[str] = _FINAL.findall(text)
    if matches:
        return matches[-1].strip()
    if "<|channel|>" not in text:
        stripped = _SPECIAL.sub("", text).strip()
        if stripped.startswith("assistant"):
            stripped = stripped[len("assistant"):].strip()
        return stripped or None
    return None
