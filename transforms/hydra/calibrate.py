"""HYDRA calibration: per-dimension aggregation weights and the drop/keep thresholds.

On validation labels (``{doc_id, scores: {dim: 0..4}}``):

- weights: the first principal component of the standardized scores (the direction along
  which the five grades agree about overall quality), signs made non-negative, normalized to
  sum 1, then shrunk toward uniform by ``n / (n + shrinkage)`` so that a small validation set
  gives near-uniform weights (an observation on small label sets, made explicit);
- aggregate = sum_d w_d * score_d (0..4);
- ``tau_keep``: the threshold whose keep rate ``mean(aggregate >= tau_keep)`` is nearest to
  ``target_keep``; ``tau_drop``: the one whose drop rate ``mean(aggregate < tau_drop)`` is
  nearest to ``target_drop`` (never above ``tau_keep``). Thresholds sit halfway between
  adjacent distinct aggregate values, so ties never straddle them.

``calibration_summary.json``: ``{weights: {dim: w}, tau_drop, tau_keep, target_keep,
achieved_keep, target_drop, achieved_drop, band_rate, num_labels, dimensions}``.
"""
from __future__ import annotations

import json
from typing import Sequence, TypedDict, cast

import numpy as np

from refinery.transforms.hydra.oracle import DIMENSIONS
from refinery.transforms.io import storage


class Thresholds(TypedDict):
    """What grading reads of a calibration: the dimensions' weights and the two thresholds."""

    weights: dict[str, float]
    tau_drop: float
    tau_keep: float


class Calibration(Thresholds):
    """``calibration_summary.json``: the thresholds and how they were fitted."""

    target_keep: float
    achieved_keep: float
    target_drop: float
    achieved_drop: float
    band_rate: float
    num_labels: int
    dimensions: list[str]


def read_labels(paths: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """(doc ids, scores [n, 5]) from label JSONL files; a bad row raises naming file and line."""
    ids, rows = [], []
    for path in paths:
        with storage.open_read(path, compression="infer") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    scores = rec["scores"]
                    rows.append([float(scores[d]) for d in DIMENSIONS])
                    ids.append(str(rec["doc_id"]))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a label row ({type(e).__name__}: {e})") from None
    return ids, np.asarray(rows, dtype=np.float64).reshape(-1, len(DIMENSIONS))


def fit_weights(scores: np.ndarray, shrinkage: float = 20.0) -> np.ndarray:
    """Aggregation weights [5] (non-negative, sum 1) from validation scores [n, 5]."""
    n, k = scores.shape
    uniform = np.full(k, 1.0 / k)
    if n < 2:
        return uniform
    std = scores.std(axis=0)
    z = (scores - scores.mean(axis=0)) / np.where(std > 0, std, 1.0)
    cov = z.T @ z / (n - 1)
    vals, vecs = np.linalg.eigh(cov)
    pc = vecs[:, -1]
    pc = pc * np.sign(pc.sum()) if pc.sum() != 0 else np.abs(pc)
    pc = np.clip(pc, 0.0, None)
    pc[std == 0] = 0.0  # a constant dimension says nothing about quality
    if pc.sum() <= 0 or vals[-1] <= 0:
        return uniform
    w = pc / pc.sum()
    lam = n / (n + shrinkage)
    weights: np.ndarray = lam * w + (1 - lam) * uniform
    return weights


def aggregate(scores: np.ndarray, weights: np.ndarray) -> np.ndarray:
    aggregated: np.ndarray = np.asarray(scores, dtype=np.float64) @ np.asarray(weights, dtype=np.float64)
    return aggregated


def threshold_for_rate(values: np.ndarray, rate: float, above: bool = True) -> tuple[float, float]:
    """(tau, achieved): the cut between distinct values whose rate of ``values >= tau``
    (``above``) or ``values < tau`` (not ``above``) is nearest to ``rate``."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    n = len(v)
    if n == 0:
        raise ValueError("no values to calibrate on")
    uniq = np.unique(v)
    cuts = np.concatenate(([uniq[0] - 1.0], (uniq[:-1] + uniq[1:]) / 2, [uniq[-1] + 1.0]))
    below = np.searchsorted(v, cuts, side="left") / n  # fraction < cut
    achieved = 1.0 - below if above else below
    best = int(np.argmin(np.abs(achieved - rate) + 1e-12 * np.arange(len(cuts))))
    return float(cuts[best]), float(achieved[best])


def calibrate(scores: np.ndarray, target_keep: float = 0.5, target_drop: float = 0.2,
              shrinkage: float = 20.0) -> Calibration:
    if not 0 < target_keep < 1:
        raise ValueError("--target-keep must be between 0 and 1")
    if not 0 <= target_drop <= 1 - target_keep:
        raise ValueError("--target-drop must be between 0 and 1 - target-keep")
    if len(scores) == 0:
        raise ValueError("no labels to calibrate on")
    w = fit_weights(scores, shrinkage)
    agg = aggregate(scores, w)
    tau_keep, keep = threshold_for_rate(agg, target_keep, above=True)
    tau_drop, drop = threshold_for_rate(agg, target_drop, above=False)
    if tau_drop > tau_keep:
        tau_drop, drop = tau_keep, float(np.mean(agg < tau_keep))
    return Calibration(weights={d: float(x) for d, x in zip(DIMENSIONS, w)}, tau_drop=tau_drop, tau_keep=tau_keep,
                       target_keep=target_keep, achieved_keep=keep, target_drop=target_drop, achieved_drop=drop,
                       band_rate=float(1.0 - keep - drop), num_labels=int(len(scores)), dimensions=list(DIMENSIONS))


def decide(aggregated: float, tau_drop: float, tau_keep: float) -> str:
    """drop below ``tau_drop``, keep at or above ``tau_keep``, band in between."""
    if aggregated < tau_drop:
        return "drop"
    if aggregated >= tau_keep:
        return "keep"
    return "band"


def load_calibration(path_or_dir: str) -> Thresholds:
    """The calibration summary at ``path_or_dir`` (a ``.json`` file, or the folder of
    ``calibration_summary.json``), refused without weights and thresholds."""
    path = path_or_dir if path_or_dir.endswith(".json") else storage.join(path_or_dir, "calibration_summary.json")
    try:
        cal = storage.read_json(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no calibration summary (run `refinery hydra calibrate`)") from None
    for key in ("weights", "tau_drop", "tau_keep"):
        if key not in cal:
            raise ValueError(f"{path}: calibration lacks {key!r}")
    return cast(Thresholds, cal)  # the keys grading reads are there (checked above); the rest as written


def weights_vector(cal: Thresholds) -> np.ndarray:
    return np.asarray([cal["weights"][d] for d in DIMENSIONS], dtype=np.float64)


def write_calibration(out_dir: str, summary: Calibration) -> str:
    path = storage.join(out_dir, "calibration_summary.json")
    storage.atomic_write_json(path, summary)
    return path

