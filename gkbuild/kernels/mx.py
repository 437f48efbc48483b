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

import functools

import torch

from .. import mxpairs

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _unpack_x4(u: torch.Tensor) -> torch.Tensor:
    """u16 [...] -> e2m1 values [..., 4]: nibble n of the u16 is element n. One table lookup per
    nibble: measured 2-5x faster than an arithmetic decode, eager and under Inductor alike."""
    v = u.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([E2M1[(v >> (4 * n)) & 0xF] for n in range(4)], dim=-1)


def _scale(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(s.to(torch.float32) - 127)


def gate_up(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """gate_up tiles W [..., 128, 2, Hp/512, Ip] u16, S [..., 16, 2, Hp/512, Ip] u8 (any leading
    expert/layer dims) -> dense [..., 2 (gate, up), Hp (hidden h), Ip (column j)] float32."""
    *lead, P, G, nht, Ip = W.shape
    w = _unpack_x4(W.movedim(-4, -2).reshape(*lead, G, nht * 16, 8, Ip))  # [.., g, block row, 8 rows, j, n]
    s = _scale(S.movedim(-4, -2).reshape(*lead, G, nht * 16, 1, Ip, 1))  # one scale per 8 x4 rows
    return (w * s).transpose(-1, -2).reshape(*lead, G, nht * P * 4, Ip)  # h = 4c + n, c = 8 * block + row


def gate_up_bias(B: torch.Tensor) -> torch.Tensor:
    """[..., P_I, 2, Ip/512, 4] -> [..., 2, Ip] in column order j = 512*it + 128*w + p."""
    *lead, P, G, nit, W4 = B.shape
    return B.to(torch.float32).movedim(-4, -1).reshape(*lead, G, nit * W4 * P)


def down(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """down tiles W [..., P_I, Ip/512, Hp] u16, S [..., P_I/8, Ip/512, Hp] u8 ->
    dense [..., Ip (column j), Hp (lane x)] float32."""
    *lead, P, nit, Hp = W.shape
    w = _unpack_x4(W.movedim(-3, -2).reshape(*lead, nit, P // 8, 8, Hp))  # [..., it, p/8, 8, x, q]
    s = _scale(S.movedim(-3, -2).reshape(*lead, nit, P // 8, 1, Hp, 1))
    w = (w * s).reshape(*lead, nit, P, Hp, 4)
    return w.movedim(-1, -3).reshape(*lead, nit * 4 * P, Hp)  # j = 512*it + 128*q + p


# -- eager readers: the same tiles through a byte-and-scale table, as rows of the transposed weights --
#
# The readers above are what the traced programs run (four nibble lookups, export-friendly). Eager
# verification decodes every expert of every layer, so it reads the tiles another way: one lookup per
# tile byte of a pair of values with its block's scale already in (``mxpairs``; 8 x4 rows of a tile,
# 16 bytes, share a scale: a block). The table is the decode of nki-library's MoE torch references,
# computed here: aws-neuron/nki-library@0759719:src/nkilib_src/nkilib/core/utils/mx_torch_common.py,
# ``unpack_float4_x4`` (:67, a 16-entry e2m1 table by nibble, nibble 0 the u16's lowest) and
# ``mx_matmul`` (:144, each value times ``torch.pow(2.0, scale - 127.0)`` in float32, unclipped): scale
# 255 (refused when a checkpoint is read) gives inf and NaN, and 254's values of 2 and up overflow to inf.
# The rows come out transposed (output column, then input), which a matmul takes as they are:
# ``x @ w.T``.


@functools.cache
def _pairs(device: str) -> torch.Tensor:
    """[65536, 2] float32: at s << 8 | b, byte b's low and high nibble as e2m1 times 2^(s - 127)."""
    b = torch.arange(256)
    values = torch.stack([E2M1[b & 0xF], E2M1[b >> 4]], dim=-1)  # [byte, nibble]
    factor = torch.exp2(torch.arange(256, dtype=torch.float32) - 127)  # a power of two: the products are exact
    return (values[None] * factor[:, None, None]).reshape(1 << 16, 2).to(device)


def _take(W: torch.Tensor, S: torch.Tensor, out: torch.Tensor | None = None,
          numpy: bool | None = None) -> torch.Tensor:
    """W [..., B, 8] u16 (8 x4 rows of a block; any strides) + S [..., B] u8 -> [..., B, 32] float32,
    nibble n of each u16 its element n. The CPU looks up through ``mxpairs``' compiled loop, a device through
    torch's indexing (``numpy`` picks one on the CPU). ``out``: a contiguous float32 buffer of that
    many elements to fill (CPU), e.g. one reused from expert to expert."""
    pairs = _pairs(str(W.device))
    if W.device.type == "cpu" if numpy is None else numpy:
        into = None if out is None else out.view(*S.shape, 32).numpy()
        return torch.from_numpy(mxpairs.take(pairs.numpy(), W.numpy(), S.numpy(), into))  # the tile read in place
    w = W.contiguous().view(torch.uint8).view(*S.shape, 16).to(torch.int32)
    return pairs[(S.to(torch.int32) << 8)[..., None] | w].reshape(*S.shape, 32)


def gate_up_rows(W: torch.Tensor, S: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up tiles W [..., 128, 2, Hp/512, Ip], S [..., 16, 2, Hp/512, Ip] -> [..., 2, Ip (column
    j), Hp (hidden h)] float32: ``gate_up`` transposed (into ``out`` when given: ``_take``)."""
    *lead, P, G, nht, Ip = W.shape
    n = len(lead)
    w = W.permute(*range(n), n + 1, n + 3, n + 2, n).reshape(*lead, G, Ip, nht, P // 8, 8)  # h = 512 ht + 4 p + nibble
    s = S.permute(*range(n), n + 1, n + 3, n + 2, n)  # [.., g, j, ht, p // 8]
    return _take(w, s, out).reshape(*lead, G, Ip, nht * P * 4)


def down_rows(W: torch.Tensor, S: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """down tiles W [..., P_I, Ip/512, Hp], S [..., P_I/8, Ip/512, Hp] -> [..., Hp (lane x), Ip]
    float32, the columns in the order j' = 512*it + 4*p + q (the tile's own); ``down_columns``
    says which kernel column j each holds (into ``out`` when given)."""
    *lead, P, nit, Hp = W.shape
    n = len(lead)
    w = W.permute(*range(n), n + 2, n + 1, n).reshape(*lead, Hp, nit, P // 8, 8)  # [.., x, it, p, q]
    s = S.permute(*range(n), n + 2, n + 1, n)  # [.., x, it, p // 8]
    return _take(w, s, out).reshape(*lead, Hp, nit * P * 4)


def down_columns(Ip: int, P: int) -> torch.Tensor:
    """j of each column j' = 512*it + 4*p + q of ``down_rows``: 512*it + 128*q + p."""
    it, p, q = torch.meshgrid(torch.arange(Ip // (4 * P)), torch.arange(P), torch.arange(4), indexing="ij")
    return (4 * P * it + P * q + p).reshape(-1)
