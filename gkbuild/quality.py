"""How far a model's next-token distributions are from a dense original's, position by position.

A dense (bf16/fp32) fine-tune is served quantized to MXFP4. Its golden holds the MXFP4 reference's
logits and the dense original's (``golden.OPTIONAL``); these measures separate what the
quantization itself changes (the MXFP4 reference against the original) from what the build adds
(the build against the original), which verify reports and ``--quant-tolerance`` gates.

Every measure is a pure function of logits [..., V] and works in float64: per-position
KL(original || other) in nats from log-softmaxes (max-subtracted: stable for any finite logits),
top-1 agreement (the same argmax), and a summary over the positions kept.
"""

from __future__ import annotations

import torch

ROWS = 64  # positions converted to float64 at a time (120b: 64 x 201088 x 8 B = 103 MB)


def kl(original: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(softmax(original) || softmax(other)) in nats per position: [..., V] x2 -> [...] float64.
    Zero where the two distributions are equal; never negative (clamped at 0 against rounding)."""
    if original.shape != other.shape:
        raise ValueError(f"logits of shapes {list(original.shape)} and {list(other.shape)}")
    lead, V = original.shape[:-1], original.shape[-1]
    a, b = original.reshape(-1, V), other.reshape(-1, V)
    out = torch.empty(a.shape[0], dtype=torch.float64)
    for lo in range(0, a.shape[0], ROWS):
        lp = torch.log_softmax(a[lo:lo + ROWS].double(), -1)
        lq = torch.log_softmax(b[lo:lo + ROWS].double(), -1)
        out[lo:lo + ROWS] = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    return out.reshape(lead)


def top1(original: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Whether the two argmaxes agree, per position: [..., V] x2 -> [...] bool."""
    return original.argmax(-1) == other.argmax(-1)


def summary(kls: torch.Tensor, agree: torch.Tensor, keep: torch.Tensor | None = None) -> dict:
    """Over the positions ``keep`` [P, T] marks (default all) of per-position ``kls`` and ``agree``
    [P, T]: mean, p99 and max KL (nats) with the worst (sequence, position), top-1 agreement rate."""
    keep = torch.ones_like(agree, dtype=torch.bool) if keep is None else keep
    n = int(keep.sum())
    if n == 0:
        return {"positions": 0, "mean_kl": None, "p99_kl": None, "max_kl": None, "worst": None, "top1_agreement": None}
    masked = kls.double().masked_fill(~keep, float("-inf"))
    worst = int(masked.reshape(-1).argmax())
    vals = kls.double()[keep]
    return {"positions": n, "mean_kl": float(vals.mean()), "p99_kl": float(torch.quantile(vals, 0.99)),
            "max_kl": float(vals.max()), "worst": [worst // kls.shape[1], worst % kls.shape[1]],
            "top1_agreement": float(agree[keep].double().mean())}


def section(original: torch.Tensor, reference: torch.Tensor, build: torch.Tensor | None = None,
            keep: torch.Tensor | None = None) -> dict:
    """The quantization report of a dense source, logits [P, T, V] each: ``reference`` (the MXFP4
    reference) and ``build`` against ``original``, each summarized and per position ([P][T] lists,
    for the plots); the build only over the positions ``keep`` marks (those it was judged on)."""
    out = {}
    for name, other, mask in (("reference", reference, None), ("build", build, keep)):
        if other is None:
            continue
        k, a = kl(original, other), top1(original, other)
        per = k.masked_fill(~mask, float("nan")) if mask is not None else k
        out[name] = {**summary(k, a, mask), "kl": per.tolist(), "top1": a.tolist()}
    return out
