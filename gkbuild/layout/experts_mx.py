"""MXFP4 experts in the nki-library MoE TKG tiles (CONTRACT.md 2a), one layer, E_L local experts.

Indices, with the HF axes first zero-padded at their ends (hidden H -> Hp, intermediate I -> Ip;
the interleaved 2I axis gets 2(Ip - I) zero rows), P_I = min(128, Ip/4):

- pi(j) = 512*(j // 512) + 4*(j mod P_I) + (j mod 512) // P_I: kernel intermediate column j holds
  HF intermediate index pi(j) (the gate_up output tile [P_I, Ip/512, 4] read back in HF order).
- U[e, row, c]: the little-endian u16 of bytes 2c, 2c+1 of an HF blocks row; nibble n is element
  4c + n, so packing four fp4 into a u16 is a plain 2-byte copy.
- gate_up weight [E_L, 128, 2, Hp/512, Ip] u16: W[e,p,g,ht,j] = U_gu[e, 2*pi(j)+g, 128*ht+p]
- gate_up scale  [E_L, 16, 2, Hp/512, Ip] u8:  S[e,s,g,ht,j] = scales_gu[e, 2*pi(j)+g, 16*ht+s]
- gate_up bias   [E_L, P_I, 2, Ip/512, 4] fp32: B[e,m,g,it,w] = bias[e, 2i+g] (+1 on up, i < I),
  i = 512*it + 4*m + w
- down weight    [E_L, P_I, Ip/512, Hp] u16: W[e,p,it,x] = U_dn[e, sigma(x), 128*it+p]
- down scale     [E_L, P_I/8, Ip/512, Hp] u8: S[e,s,it,x] = scales_dn[e, sigma(x), 16*it+s]
- down bias      [E_L, Hp] fp32: bias_dn[e, sigma(x)]

With +1 folded into the up bias the clamps become gate <= limit, up in [-limit+1, limit+1].
"""

from __future__ import annotations

import numpy as np

from . import arrays, hidden
from .dims import MX_TILE, P_MAX, Dims
from .scalars import UP_BIAS_SHIFT


def pi(Ip: int, P_I: int) -> np.ndarray:
    """pi[j]: the HF intermediate index kernel column j holds."""
    j = np.arange(Ip)
    return MX_TILE * (j // MX_TILE) + 4 * (j % P_I) + (j % MX_TILE) // P_I


def _u16(blocks: np.ndarray) -> np.ndarray:
    """[..., rows, G, 16] u8 -> [..., rows, G*8] u16: bytes 2c, 2c+1 little-endian (a free view)."""
    b = np.ascontiguousarray(blocks)
    return b.reshape(b.shape[:-2] + (-1,)).view(np.uint16)


def _u8(u: np.ndarray, groups: int) -> np.ndarray:
    """Inverse of :func:`_u16`."""
    return np.ascontiguousarray(u).view(np.uint8).reshape(u.shape[:-1] + (groups, 16))


def _pad_gate_up(dims: Dims, a: np.ndarray) -> np.ndarray:
    """Pad the interleaved [.., 2I, ...] axis (axis 1) to 2Ip."""
    return hidden.pad(a, 1, 2 * dims.Ip)


def _padded(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[E_L, r, c] zero-padded at the end of both axes to [E_L, rows, cols]."""
    if a.shape[1:] == (rows, cols):
        return a
    r, c = a.shape[1:]
    out = np.empty((a.shape[0], rows, cols), a.dtype)  # only the padding is zeroed: one pass, not two
    out[:, :r, :c] = a
    out[:, :r, c:] = 0
    out[:, r:] = 0
    return out


def _tiles(dims: Dims, a: np.ndarray, inner: int) -> np.ndarray:
    """Padded gate_up rows [E_L, 2Ip, nht*inner] (row = 2i+g, i = 512*it + 4*m + w) ->
    [E_L, inner, 2, nht, Ip] with column j = 512*it + P_I*w + m: pi is the (m, w) swap."""
    E_L, nht, nit = a.shape[0], dims.Hp // MX_TILE, dims.Ip // MX_TILE
    s = arrays.permute(a, (E_L, nit, dims.P_I, 4, 2, nht, inner), (0, 4, 5, 1, 3, 2, 6))
    return arrays.transpose(s.reshape(E_L, 2 * nht * dims.Ip, inner)).reshape(E_L, inner, 2, nht, dims.Ip)


def gate_up_weights(dims: Dims, blocks: np.ndarray) -> np.ndarray:
    """HF gate_up_proj_blocks [E_L, 2I, H/32, 16] -> [E_L, 128, 2, Hp/512, Ip] u16."""
    return _tiles(dims, _padded(_u16(blocks), 2 * dims.Ip, dims.Hp // 4), P_MAX)


def gate_up_scales(dims: Dims, scales: np.ndarray) -> np.ndarray:
    """HF gate_up_proj_scales [E_L, 2I, H/32] -> [E_L, 16, 2, Hp/512, Ip] u8."""
    return _tiles(dims, _padded(np.asarray(scales), 2 * dims.Ip, dims.Hp // 32), 16)


def gate_up_bias(dims: Dims, bias: np.ndarray) -> np.ndarray:
    """HF gate_up_proj_bias [E_L, 2I] -> [E_L, P_I, 2, Ip/512, 4] fp32, +1 folded into up."""
    E_L = bias.shape[0]
    b = arrays.f32(_pad_gate_up(dims, bias)).reshape(E_L, dims.Ip, 2)
    b[:, :dims.I, 1] += np.float32(UP_BIAS_SHIFT)
    return np.ascontiguousarray(b.reshape(E_L, dims.Ip // MX_TILE, dims.P_I, 4, 2).transpose(0, 2, 4, 1, 3))


def gate_up(dims: Dims, blocks: np.ndarray, scales: np.ndarray, bias: np.ndarray):
    """HF gate_up_proj_{blocks, scales, bias} -> (W, S, B); undone by :func:`gate_up_inverse`."""
    return gate_up_weights(dims, blocks), gate_up_scales(dims, scales), gate_up_bias(dims, bias)


def gate_up_inverse(dims: Dims, W: np.ndarray, S: np.ndarray, B: np.ndarray, bias_dtype):
    """(W, S, B) -> HF (blocks, scales, bias), checking the padding is zero."""
    E_L = W.shape[0]
    inv = np.argsort(pi(dims.Ip, dims.P_I))
    u = W.transpose(0, 4, 2, 3, 1).reshape(E_L, dims.Ip, 2, dims.Hp // 4)[:, inv]
    blocks = _u8(u.reshape(E_L, 2 * dims.Ip, dims.Hp // 4), dims.Hp // 32)
    s = S.transpose(0, 4, 2, 3, 1).reshape(E_L, dims.Ip, 2, dims.Hp // 32)[:, inv]
    scales = s.reshape(E_L, 2 * dims.Ip, dims.Hp // 32)
    b = B.transpose(0, 3, 1, 4, 2).reshape(E_L, dims.Ip, 2).copy()
    b[:, :dims.I, 1] -= np.float32(UP_BIAS_SHIFT)
    bias = b.reshape(E_L, 2 * dims.Ip)
    strip = lambda a, axis, n: hidden.unpad(a, axis, n)  # noqa: E731
    blocks = strip(strip(blocks, 1, 2 * dims.I), 2, dims.H // 32)
    scales = strip(strip(scales, 1, 2 * dims.I), 2, dims.H // 32)
    return blocks, scales, strip(bias, 1, 2 * dims.I).astype(bias_dtype)


def _down_tiles(dims: Dims, a: np.ndarray, inner: int) -> np.ndarray:
    """Padded down rows [E_L, Hp (HF order), nit*inner] -> [E_L, inner, nit, Hp (kernel lanes)]."""
    E_L, nit = a.shape[0], dims.Ip // MX_TILE
    lanes = arrays.permute(a, (E_L, dims.Hp // 4, 4, nit * inner), (0, 2, 1, 3))  # row x has HF sigma(x)
    t = arrays.transpose(lanes.reshape(E_L, dims.Hp, nit * inner))  # [E_L, (it, p), x]
    return arrays.permute(t, (E_L, nit, inner, dims.Hp), (0, 2, 1, 3))


def down_weights(dims: Dims, blocks: np.ndarray) -> np.ndarray:
    """HF down_proj_blocks [E_L, H, I/32, 16] -> [E_L, P_I, Ip/512, Hp] u16."""
    return _down_tiles(dims, _padded(_u16(blocks), dims.Hp, dims.Ip // 4), dims.P_I)


def down_scales(dims: Dims, scales: np.ndarray) -> np.ndarray:
    """HF down_proj_scales [E_L, H, I/32] -> [E_L, P_I/8, Ip/512, Hp] u8."""
    return _down_tiles(dims, _padded(np.asarray(scales), dims.Hp, dims.Ip // 32), dims.P_I // 8)


def down_bias(dims: Dims, bias: np.ndarray) -> np.ndarray:
    """HF down_proj_bias [E_L, H] -> [E_L, Hp] fp32 in kernel lanes."""
    return hidden.to_kernel(arrays.f32(bias), 1, dims.Hp)


def down(dims: Dims, blocks: np.ndarray, scales: np.ndarray, bias: np.ndarray):
    """HF down_proj_{blocks, scales, bias} -> (W, S, B); undone by :func:`down_inverse`."""
    return down_weights(dims, blocks), down_scales(dims, scales), down_bias(dims, bias)


def down_inverse(dims: Dims, W: np.ndarray, S: np.ndarray, B: np.ndarray, bias_dtype):
    E_L = W.shape[0]
    u = W.transpose(0, 3, 2, 1).reshape(E_L, dims.Hp, dims.Ip // 4)
    blocks = hidden.unpad(hidden.from_kernel(_u8(u, dims.Ip // 32), 1, dims.H), 2, dims.I // 32)
    s = S.transpose(0, 3, 2, 1).reshape(E_L, dims.Hp, dims.Ip // 32)
    scales = hidden.unpad(hidden.from_kernel(s, 1, dims.H), 2, dims.I // 32)
    return blocks, scales, hidden.from_kernel(B, 1, dims.H).astype(bias_dtype)

