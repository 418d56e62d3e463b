"""The one JSON canonical form refinery hashes (stage hashes, input fingerprints, unit ids)."""
from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def short_hash(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()[:length]
