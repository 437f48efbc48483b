"""Dequantize the kernel's MX expert tiles the way nki-library's MoE twin reads them.

These readers work from the tiled layout alone (they never call the layout functions' inverses),
so a byte in the wrong place in a shard gives a wrong number here.

Index spaces:
- hidden h: the padded-HF hidden index (an x4 element c holds h = 4c..4c+3; the kernel feeds the
  activation in this order, which is what the [H/4,4] -> [4,H/4] lane shuffle is for);
- intermediate j: the kernel's column order; the gate_up output tile out[p, it, w] is column
  j = 512*it + 128*w + p, and the down projection's x4 row (it, p) nibble q is column
  j = 512*it + 128*q + p;
- output x: kernel hidden lanes.
"""

from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _unpack_x4(u: torch.Tensor) -> torch.Tensor:
    """u16 [...] -> e2m1 values [..., 4]: nibble n of the u16 is element n."""
    v = u.view(torch.int16).to(torch.int32) & 0xFFFF
    return E2M1[torch.stack([(v >> (4 * n)) & 0xF for n in range(4)], dim=-1)]


def _scale(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(s.to(torch.float32) - 127)


def gate_up(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """One expert's gate_up tiles W [128, 2, Hp/512, Ip] u16, S [16, 2, Hp/512, Ip] u8 ->
    dense [2 (gate, up), Hp (hidden h), Ip (column j)] float32."""
    P, G, nht, Ip = W.shape
    w = _unpack_x4(W.permute(1, 2, 0, 3).reshape(G, nht * P, Ip))  # [g, c = 128*ht + p, j, n]
    s = _scale(S.permute(1, 2, 0, 3).reshape(G, nht * 16, Ip))  # [g, block row = 16*ht + s, j]
    w = w * s.repeat_interleave(8, dim=1)[..., None]  # one scale per 8 x4 rows (32 elements)
    return w.permute(0, 1, 3, 2).reshape(G, nht * P * 4, Ip)  # h = 4c + n


def gate_up_bias(B: torch.Tensor) -> torch.Tensor:
    """[P_I, 2, Ip/512, 4] -> [2, Ip] in column order j = 512*it + 128*w + p."""
    return B.to(torch.float32).permute(1, 2, 3, 0).reshape(B.shape[1], -1)


def down(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """One expert's down tiles W [P_I, Ip/512, Hp] u16, S [P_I/8, Ip/512, Hp] u8 ->
    dense [Ip (column j), Hp (lane x)] float32."""
    P, nit, Hp = W.shape
    w = _unpack_x4(W.permute(1, 0, 2))  # [it, p, x, q]
    s = _scale(S.permute(1, 0, 2)).repeat_interleave(8, dim=1)  # [it, p, x]
    w = w * s[..., None]
    return w.permute(0, 3, 1, 2).reshape(nit * 4 * P, Hp)  # j = 512*it + 128*q + p
