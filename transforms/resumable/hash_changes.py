"""Why a plan changed since the last run in an output folder: which inputs, settings or
identities moved, in one line a stage (see :func:`explain_plan_changes`)."""
from __future__ import annotations

import json
from typing import Any

from refinery.transforms.io import storage
from refinery.transforms.resumable.ledger import fingerprints_path
from refinery.transforms.resumable.run_record import RunRecord, StageEntry


def fingerprints_bytes(fingerprints: list[Any]) -> bytes:
    """The bytes of a plan's recorded input fingerprints, as they are written (and compared)."""
    return (json.dumps(fingerprints, indent=1, sort_keys=True) + "\n").encode()


def _fingerprint_key(fp: Any) -> str:
    return fp.get("path", json.dumps(fp, sort_keys=True)) if isinstance(fp, dict) else json.dumps(fp, sort_keys=True)


def diff_fingerprints(old: list[Any], new: list[Any], limit: int = 5) -> str:
    """'1 changed: a.jsonl (size 10 -> 12); 1 added: b.jsonl' between two fingerprint lists."""
    before = {_fingerprint_key(f): f for f in old}
    after = {_fingerprint_key(f): f for f in new}
    changed = [k for k in after if k in before and after[k] != before[k]]
    added = [k for k in after if k not in before]
    removed = [k for k in before if k not in after]
    parts = []
    if changed:
        def what(k: str) -> str:
            o, n = before[k], after[k]
            keys = [x for x in sorted(set(o) | set(n)) if o.get(x) != n.get(x)] if isinstance(o, dict) else []
            return f"{k} ({', '.join(f'{x} {o.get(x)} -> {n.get(x)}' for x in keys)})"
        parts.append(f"{len(changed)} changed: " + "; ".join(what(k) for k in changed[:limit])
                     + (" ..." if len(changed) > limit else ""))
    if added:
        parts.append(f"{len(added)} added: " + ", ".join(added[:limit]) + (" ..." if len(added) > limit else ""))
    if removed:
        parts.append(f"{len(removed)} removed: " + ", ".join(removed[:limit])
                     + (" ..." if len(removed) > limit else ""))
    return "; ".join(parts) or "their order changed"


def explain_plan_changes(output: str, previous: RunRecord, entries: list[StageEntry]) -> list[str]:
    """Why each stage's plan differs from the previous run recorded in run.json (one line per
    stage whose hash changed): its config, its inputs (naming the files), its identity (e.g.
    the tokenizer), or only an earlier stage. Stages with the same hash are not mentioned."""
    old = {st.get("name"): st for st in previous.get("stages", []) if isinstance(st, dict)}
    lines = []
    changed_before: str | None = None
    for new in entries:
        prev = old.get(new["name"])
        if prev is None or prev.get("stage_hash") == new["stage_hash"]:
            continue
        reasons = []
        if prev.get("config") != new["config"]:
            oc, nc = prev.get("config") or {}, new["config"]
            keys = [k for k in sorted(set(oc) | set(nc)) if oc.get(k) != nc.get(k)]
            reasons.append("config changed: " + ", ".join(f"{k} {oc.get(k)!r} -> {nc.get(k)!r}" for k in keys))
        if "inputs_hash" in prev and prev["inputs_hash"] != new["inputs_hash"]:
            try:
                old_fps = storage.read_json(fingerprints_path(output, new["name"], prev["stage_hash"]))
                new_fps = storage.read_json(fingerprints_path(output, new["name"], new["stage_hash"]))
                reasons.append("inputs changed: " + diff_fingerprints(old_fps, new_fps))
            except (FileNotFoundError, ValueError):
                reasons.append("inputs changed (size, mtime or generation of an input file)")
        if "identity_hash" in prev and prev["identity_hash"] != new["identity_hash"]:
            reasons.append("identity changed (e.g. the tokenizer or model)")
        if not reasons:
            reasons.append(f"stage {changed_before} before it changed" if changed_before else "its plan changed")
        lines.append(f"stage {new['name']}: plan {prev.get('stage_hash')} -> {new['stage_hash']} because "
                     f"{'; '.join(reasons)}; its earlier outputs are not reused")
        changed_before = changed_before or new["name"]
    return lines
