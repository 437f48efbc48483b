"""The torch twins as ``nn.Module`` programs whose positional inputs follow a signature: what the
inductor backend exports, and what a runtime calls (compiled or not) with the same arguments."""

from __future__ import annotations

import torch

from ..kernels import decode as dec, tail as tl
from ..kernels.collectives import Single
from ..layout.kv import KvLayout
from ..kv_buffers import KvBuffers
from .signature import Signature


class DecodeProgram(torch.nn.Module):
    """One decode step of one rank (world size 1): (x, control..., weights..., K..., V...) ->
    (x_out, hidden_states [L, B, Hp]); the new token's K/V is written into the K/V inputs in place."""

    def __init__(self, sig: Signature, sc: dec.Scalars, kv: KvLayout):
        super().__init__()
        self.names = [i.name for i in sig.inputs]
        self.weights = sig.names("weight")
        self.kv_names = sig.names("kv_buffer")
        self.sc, self.kv = sc, kv

    def forward(self, *args):
        a = dict(zip(self.names, args))
        ctl = dec.Control(**{f: a[f] for f in dec.Control.FIELDS})
        hid: list = []
        kv = KvBuffers.from_arguments(self.kv, {n: a[n] for n in self.kv_names})
        x = dec.step({n: a[n] for n in self.weights}, a["x"], kv, ctl, self.sc, Single(), hid)
        return x, torch.stack(hid)


class TailProgram(torch.nn.Module):
    """The sampling tail of one rank (world size 1): (hidden, sampling_params, gamma, lm_head_weight_t)
    -> (tokens, topk_values, topk_indices[, logits])."""

    def __init__(self, k: int, eps: float, hidden_actual: int, emit_logits: bool):
        super().__init__()
        self.k, self.eps, self.hidden_actual, self.emit_logits = k, eps, hidden_actual, emit_logits

    def forward(self, *args):  # (hidden, sampling_params, gamma, lm_head_weight_t), as the decode program
        hidden, sampling_params, gamma, lm_head_weight_t = args
        out = tl.step(hidden, gamma, lm_head_weight_t, Single(), 1, self.k, self.eps, self.hidden_actual,
                      sampling_params, self.emit_logits)
        res = (out.tokens, out.topk_values, out.topk_indices)
        return res + (out.logits,) if self.emit_logits else res


def example_inputs(sig: Signature, batch: int) -> list[torch.Tensor]:
    """Zero tensors of the signature's shapes (the batch dimension at ``batch``): what a trace needs."""
    out = []
    for i in sig.inputs:
        shape = [batch if s == "batch" else s for s in i.shape]
        out.append(torch.zeros(shape, dtype=getattr(torch, i.dtype)))
    return out
