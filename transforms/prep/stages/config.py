"""The settings of a prep job (:class:`PrepConfig`) and what every stage checks of its inputs
(:func:`check_unchanged`): the bottom of :mod:`refinery.transforms.prep.stages`."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from refinery.transforms.formats.tokenizer_choice import DEFAULT, TokenizerSpec
from refinery.transforms.io import storage
from refinery.transforms.io.rows import (
    DEFAULT_MAX_ROW_BYTES,
)
from refinery.transforms.io.text import TextSpec
from refinery.transforms.prep.exclusion import Exclusion

UNIT_BYTES = 16 << 20  # default input bytes per tokenize unit: small files are grouped, big .jsonl files split


@dataclass
class PrepConfig:
    inputs: list[storage.InputFile]
    output: str
    dataset: str
    num_shards: int = 8
    text_field: str = "text"
    id_field: str = "id"
    max_tokens: int | None = None
    row_groups_per_unit: int = 8
    unit_bytes: int = UNIT_BYTES  # 0: one unit per file (no grouping, no byte ranges)
    wave_units: int = 4
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES  # a larger row is rejected as too large, never held whole
    source: dict[str, Any] = field(default_factory=dict)  # how the inputs were named (e.g. HF dataset + revision)
    exclude: Exclusion | None = None  # training rows left out: decon drop lists (--exclude-overlaps)
    text_template: str | None = None  # set: the text is this template over the rows' fields (text_field unused)
    tokenizer: TokenizerSpec = DEFAULT  # resolved in the driver (formats.tokenizer_choice.resolve_tokenizer)
    encoder: str = "fast"  # "fast", "bpe-openai", "tiktoken": the same tokens (formats.encoders.ENCODERS)
    num_inputs: int = -1  # len(inputs); kept when a job carries the config without its input list

    def __post_init__(self) -> None:
        self.num_inputs = len(self.inputs)

    @property
    def text(self) -> TextSpec:
        """Where each row's text comes from: the template when set, else the text field."""
        return TextSpec.from_options(None, self.text_template, self.text_field)

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: the settings, not the input list (the driver's: it made the plan,
        which the workers read from the output), so that the job does not grow with the corpus."""
        return {**self.__dict__, "inputs": None}


# ---------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------

def parse_token_count(value: str) -> int:
    """'100M' -> 100_000_000; suffixes K, M, B, T (powers of 1000); plain integers too."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT]?)\s*", str(value))
    if not m:
        raise ValueError(f"not a token count: {value!r} (use e.g. 500K, 100M, 2B)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def check_unchanged(payload: Mapping[str, Any]) -> None:
    """Raise :class:`storage.InputError` if the unit's input file is gone or changed (size, mtime
    or generation) since the job was planned: its stage hash names the planned version."""
    planned = payload.get("fingerprint")
    if planned is None:
        return
    now = storage.expand_inputs([payload["path"]])[0].fingerprint()
    if storage.is_remote(payload["path"]):  # object listings and single-object info may spell the version differently
        now, planned = now["size"], planned["size"]
    if now != planned:
        raise storage.InputError(f"{payload['path']}: changed since this job was planned (now {now}, planned "
                            f"{planned}); run the same command again to plan with the new version")
