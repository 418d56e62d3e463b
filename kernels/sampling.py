"""Per-document seeded sampling that runs on the logits' device.

The pipelines' rule (``refinery.transforms.inference.handler.sample_rows`` calls this): row ``b`` draws
one float64 uniform ``u`` from its own ``torch.Generator`` (CPU), and picks the first token whose
float64 cumulative probability under ``softmax(logits / temperature)`` exceeds
``u * total``, so a document's tokens depend only on its own seed and its own logits.

Here the uniforms are still drawn on the host from the same generators, in the same order
(one ``torch.rand((), dtype=float64)`` per row and step), which keeps every document's
random stream exactly as it was; only ``B`` floats travel to the device, and the softmax,
cumulative sum and search run where the logits are, instead of copying ``[B, vocab]`` logits
to the host. On CPU the tokens are identical to ``sample_rows``'s (same float64 operations,
same order); on a GPU the float64 softmax and cumulative sum may differ in the last bits,
which changes a token only when ``u`` falls within that much of a boundary.
"""
from __future__ import annotations

from typing import Sequence

import torch


def constrain_logits(logits: torch.Tensor, allowed: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """``logits [B, V]`` with every token outside row ``b``'s ``allowed[b]`` set to ``-inf``
    (constrained decoding); a row whose ``allowed`` is None is left as it is. Returns
    ``logits`` itself when no row is constrained."""
    if len(allowed) != logits.shape[0]:
        raise ValueError(f"{len(allowed)} allowed-token sets for {logits.shape[0]} rows of logits")
    if all(a is None for a in allowed):
        return logits
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    for b, tokens in enumerate(allowed):
        if tokens is None:
            keep[b] = True
        elif not tokens:
            raise ValueError(f"row {b}: no allowed token")
        else:
            keep[b, list(tokens)] = True
    return logits.masked_fill(~keep.to(logits.device), float("-inf"))


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One float64 uniform per row from each row's own generator: ``[B]`` on the CPU."""
    if not generators:
        return torch.empty(0, dtype=torch.float64)
    return torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])


def sample_rows_device(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids ``[B]`` (long, on ``logits``' device) for ``logits [B, V]``: greedy when
    ``temperature <= 0`` (``uniforms`` unused), else the inverse-CDF draw at ``uniforms [B]``
    (float64, any device). No host synchronisation."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = uniforms.to(device=cdf.device, dtype=torch.float64, non_blocking=True) * cdf[:, -1]
    picked = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp_(max=logits.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, temperature: float, generators: Sequence[torch.Generator]) -> list[int]:
    """``refinery.transforms.inference.handler.sample_rows`` computed on ``logits``' device: the
    same tokens for the same generators (identical on CPU), one ``[B]`` copy back to the host."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    return sample_rows_device(logits, temperature, draw_uniforms(generators)).tolist()
