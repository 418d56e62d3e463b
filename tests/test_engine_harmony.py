"""Harmony prompts and completions, offline (openai-harmony reading the local o200k vocab)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

pytest.importorskip("openai_harmony", reason="the inference extra (openai-harmony) is not installed")

from refinery.transforms.formats import harmony  # noqa: E402


@pytest.fixture(scope="module")
def encoding() -> HarmonyEncoding:
    return harmony.harmony_encoding()


def _encode(encoding: HarmonyEncoding, text: str) -> list[int]:
    return list(encoding.encode(text, allowed_special="all"))


def test_stop_tokens(encoding: HarmonyEncoding) -> None:
    assert sorted(harmony.stop_tokens()) == [200002, 200012]
    assert set(harmony.STOP_TOKENS) == set(harmony.stop_tokens())
    assert _encode(encoding, "<|return|>") == [harmony.RETURN_TOKEN]
    assert _encode(encoding, "<|call|>") == [harmony.CALL_TOKEN]


def test_render_prompt(encoding: HarmonyEncoding) -> None:
    tokens = harmony.render_prompt(
        system="You are a careful grader.", developer="Answer with one word.", user="Is water wet?"
    )
    text = encoding.decode(tokens)
    assert text.startswith("<|start|>system<|message|>You are a careful grader.")
    assert "Reasoning: low" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer with one word.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Is water wet?<|end|><|start|>assistant")
    same = harmony.render_prompt(
        [
            {"role": "system", "content": "You are a careful grader."},
            {"role": "developer", "content": "Answer with one word."},
            {"role": "user", "content": "Is water wet?"},
        ]
    )
    assert same == tokens
    with pytest.raises(ValueError):
        harmony.render_prompt([{"role": "robot", "content": "x"}])


def test_parse_final_round_trip(encoding: HarmonyEncoding) -> None:
    """Both directions through openai-harmony's own renderer and parser, not our strings."""
    import openai_harmony as oh

    text = "Yes, très humide."
    rendered = list(encoding.render(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("final")))
    head = _encode(encoding, "<|start|>assistant")
    assert rendered[:len(head)] == head
    completion = rendered[len(head):]  # what the generator produces after the prompt's "<|start|>assistant"
    assert harmony.parse_final(completion) == text
    [parsed] = encoding.parse_messages_from_completion_tokens(completion, oh.Role.ASSISTANT)
    assert parsed.channel == "final" and parsed.content[0].text == text

    # our prompt, parsed back by harmony: the same roles and contents
    prompt = harmony.render_prompt(system="You grade.", developer="One word.", user="Is water wet?")
    messages = encoding.parse_messages_from_completion_tokens(prompt[:-len(head)])
    assert [m.author.role for m in messages] == [oh.Role.SYSTEM, oh.Role.DEVELOPER, oh.Role.USER]
    assert messages[-1].content[0].text == "Is water wet?"
    assert "One word." in messages[1].content[0].text and "You grade." in messages[0].content[0].text


def test_parse_final_defensive(encoding: HarmonyEncoding) -> None:
    truncated = _encode(encoding, "<|channel|>final<|message|>cut off mid")
    assert harmony.parse_final(truncated) == "cut off mid"
    analysis_only = _encode(encoding, "<|channel|>analysis<|message|>still thinking")
    assert harmony.parse_final(analysis_only) is None
    bare = _encode(encoding, "I can't help with that.<|return|>")
    assert harmony.parse_final(bare) == "I can't help with that."
    malformed = _encode(
        encoding, "<|channel|>final junk<|channel|>final<|message|>recovered<|end|>"
    )
    assert harmony.parse_final(malformed) == "recovered"
    constrained = _encode(encoding, "<|channel|>final <|constrain|>json<|message|>{\"a\": 1}<|return|>")
    assert harmony.parse_final(constrained) == '{"a": 1}'
    assert harmony.parse_final([]) is None
