"""A unit of work, the smallest thing a stage plans, runs and records a receipt for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Mapping, TypeVar

Payload = TypeVar("Payload", bound=Mapping[str, Any], covariant=True)
"""A stage's unit payload: its own TypedDict (prep's ``TokenizePayload``), JSON-able."""


@dataclass(frozen=True)
class Unit(Generic[Payload]):
    """One unit of work: a stable, file-name-safe id and a JSON-able payload of the stage's type."""

    id: str
    payload: Payload
