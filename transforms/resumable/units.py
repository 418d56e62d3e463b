"""A unit of work, the smallest thing a stage plans, runs and records a receipt for."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Unit:
    """One unit of work: a stable, file-name-safe id and a JSON-able payload."""

    id: str
    payload: Mapping[str, Any] = field(default_factory=dict)  # a stage's own TypedDict, e.g. prep's TokenizePayload
